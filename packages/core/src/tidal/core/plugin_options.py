"""What a plugin's options are: a msgspec Struct per plugin, checked before anything is built.

A factory says what it takes in one of three ways, tried in this order:

- ``@declare(options=MyOptions)``: a `ConfigStruct` (kw_only, unknown fields forbidden) of its own;
- ``@declare(signature="my_pkg.module:MyClass")``: the keyword parameters of that callable (a class's
  ``__init__``), imported only when the options are checked, so that scanning plugins stays light (no
  torch); ``skip`` names parameters that the caller fills in, not the user;
- nothing: the factory's own signature, when it lists its keyword parameters. A factory that takes only
  ``**options`` and declares nothing is *unchecked*: its options reach it as they are, and `tidal plugins`
  says so.

An option that changes nothing in some settings says so, so that a recipe setting it there is refused
rather than silently ignored, and so that tests can check every other option acts (issue 40):
``acts_with={"norm_length": {"agg": "seq-mean-token-sum-norm"}}`` (it acts only when those options have
those values; `NONZERO` for "set to anything but 0, None or False"); ``metric_only=("eps",)`` for an
option that changes only what is logged, never the result.

Parameters that the framework passes positionally (an engine's model folder, a train backend's model,
config and device) are not options; `FRAMEWORK_ARGS` names them per kind.

From a signature, each keyword parameter becomes a field with its annotation (or ``Any`` where msgspec
cannot check the type, e.g. a ``torch.device``) and its default (required when it has none).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import msgspec.inspect

from tidal.core.errors import ConfigError

# positional parameters the framework fills in when it builds a plugin of this kind (never user options)
FRAMEWORK_ARGS: dict[str, int] = {"engine": 1, "train_backend": 3, "renderer": 1}

_DECLARED = "__tidal_options__"
_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


class NoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of a plugin that takes none."""


NONZERO = "<nonzero>"  # an `acts_with` condition: the option is set to anything but 0, None or False


class Declared(msgspec.Struct, frozen=True):
    options: type | None = None  # a Struct type
    signature: str = ""  # "module:attr" whose keyword parameters are the options
    skip: tuple[str, ...] = ()  # parameters of that signature that are not user options
    # option -> {other option: the value it needs (or NONZERO)}: where else the option changes nothing
    acts_with: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    metric_only: tuple[str, ...] = ()  # options that change only metrics, never the result


def declare(factory: Callable[..., Any] | None = None, *, options: type | None = None, signature: str = "",
            skip: tuple[str, ...] = (), acts_with: Mapping[str, Mapping[str, Any]] | None = None,
            metric_only: tuple[str, ...] = ()) -> Any:
    """Mark a plugin factory with the options it takes and where they act (see the module docstring).
    Usable as ``@declare(options=...)`` or ``declare(fn, signature="pkg.mod:Cls")``."""
    spec = Declared(options=options, signature=signature, skip=tuple(skip),
                    acts_with={k: dict(v) for k, v in (acts_with or {}).items()}, metric_only=tuple(metric_only))

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _DECLARED, spec)
        return f

    return mark(factory) if factory is not None else mark


def declared(factory: Callable[..., Any]) -> Declared:
    """What `factory` declares of its options (an empty `Declared` when it declares nothing)."""
    return getattr(factory, _DECLARED, None) or Declared()


def check_acts(options: Mapping[str, Any], typ: type, spec: Declared, *, field: str, what: str) -> None:
    """Refuse an option given where it changes nothing (`spec.acts_with`): a `ConfigError` naming it, the
    option it needs and the value that option has here."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(typ)}
    for opt, needs in spec.acts_with.items():
        if opt not in options:
            continue
        for other, want in needs.items():
            have = options[other] if other in options else defaults.get(other)
            if (bool(have) if want == NONZERO else have == want):
                continue
            wanted = "a nonzero value" if want == NONZERO else repr(want)
            raise ConfigError(f"`{field}.{opt}`: {what}: {opt} acts only with {other} = {wanted} (here {have!r}), "
                              f"so it would change nothing; remove it, or set `{field}.{other}`", field=f"{field}.{opt}")


def options_type(kind: str, name: str, factory: Callable[..., Any]) -> type | None:
    """The Struct type of the options `factory` (registered as `name` of `kind`) takes, or None when
    it is unchecked (only ``**options`` and nothing declared)."""
    spec: Declared | None = getattr(factory, _DECLARED, None)
    if spec is not None and spec.options is not None:
        return spec.options
    if spec is not None and spec.signature:
        target = _resolve(spec.signature)
        return _from_signature(f"{name}_options", target, skip=spec.skip, positional=FRAMEWORK_ARGS.get(kind, 0))
    return _from_signature(f"{name}_options", factory, skip=spec.skip if spec else (),
                           positional=FRAMEWORK_ARGS.get(kind, 0))


def signature_options(struct_name: str, *targets: str | Callable[..., Any], skip: tuple[str, ...] = (),
                      positional: int = 0) -> type:
    """One options Struct from the keyword parameters of several callables (``"module:attr"`` or the
    callable itself), for a plugin whose options are split over layers: e.g. a weight sender's own
    options and those it forwards (``**transport_options``) to its transport. ``**kwargs`` parameters
    add nothing; the first `positional` parameters of each target are the caller's."""
    fields: dict[str, tuple[Any, ...]] = {}
    for target in targets:
        fields.update((f[0], f) for f in _fields(_resolve(target) if isinstance(target, str) else target,
                                                 skip=skip, positional=positional, strict=False) or [])
    return msgspec.defstruct(struct_name, list(fields.values()), kw_only=True, forbid_unknown_fields=True)


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def _from_signature(struct_name: str, target: Any, *, skip: tuple[str, ...], positional: int) -> type | None:
    fields = _fields(target, skip=skip, positional=positional, strict=True)
    if fields is None:
        return None
    return msgspec.defstruct(struct_name, fields, kw_only=True, forbid_unknown_fields=True)


def _fields(target: Any, *, skip: tuple[str, ...], positional: int, strict: bool) -> list | None:
    """(name, type[, default]) per user option of `target`; None if it cannot be known (no signature, or,
    with `strict`, a ``**kwargs`` that forwards options somewhere we cannot see)."""
    func = target.__init__ if inspect.isclass(target) else target
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # an annotation that does not resolve here: unchecked types, names still checked
        hints = {}
    params = list(sig.parameters.values())
    if strict and any(p.kind is p.VAR_KEYWORD for p in params):
        return None  # it forwards **options somewhere we cannot see
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    filled = 0
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and filled < positional:
            filled += 1
            continue
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY, p.VAR_KEYWORD) or p.name in skip:
            continue
        typ = _checkable(hints.get(p.name, Any))
        fields.append((p.name, typ) if p.default is p.empty else (p.name, typ, _default(p.default)))
    return fields


def _checkable(typ: Any) -> Any:
    """`typ` if msgspec can validate it, else Any (the name is still checked, the value is not)."""
    try:
        msgspec.inspect.type_info(typ)
    except Exception:
        return Any
    return typ


def _default(value: Any) -> Any:
    if isinstance(value, (list, dict, set)):
        return msgspec.field(default_factory=functools.partial(type(value), value))  # a fresh copy each time
    return value


def fit(options: Mapping[str, Any], typ: type, *, field: str, what: str) -> dict[str, Any]:
    """`options` checked against the options Struct `typ`: the given keys with their values converted
    (the factory's own defaults stay for the rest). A misfit is a `ConfigError` naming the field path
    (``domains[0].options.levl``), `what` refused it, a near name, and every option with its type."""
    try:
        value: Any = msgspec.convert(dict(options), typ)
    except msgspec.ValidationError as e:
        text, where = str(e), field
        m = _AT.search(text)
        if m:
            text = text[: m.start()]
            if m.group("path").lstrip("."):
                where = f"{field}.{m.group('path').lstrip('.')}"
        unknown = re.fullmatch(r"Object contains unknown field `(?P<f>[^`]*)`", text)
        if unknown:
            known = [f for f, _, _ in describe(typ)]
            close = difflib.get_close_matches(unknown.group("f"), known, n=1)
            text = f"no option {unknown.group('f')!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            where = f"{field}.{unknown.group('f')}"
        raise ConfigError(f"`{where}`: {what}: {text}; it takes: {options_text(typ)}", field=where) from None
    return {k: getattr(value, k) for k in options}


def options_text(typ: type | None) -> str:
    """``a: int = 1, b: str (required)``: an options Struct as one line."""
    if typ is None:
        return "options not declared (passed unchecked)"
    fields = describe(typ)
    return ", ".join(f"{f}: {t}" + (f" = {d}" if d else " (required)") for f, t, d in fields) or "no options"


def describe(typ: type | None) -> list[tuple[str, str, str]]:
    """(field, type, default) of an options Struct, for listings; default '' for a required field."""
    if typ is None:
        return []
    out = []
    for f in msgspec.structs.fields(typ):
        if f.default is not msgspec.NODEFAULT:
            default = repr(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            default = repr(f.default_factory())
        else:
            default = ""
        out.append((f.name, _type_name(f.type), default))
    return out


def _type_name(typ: Any) -> str:
    if typ is Any:
        return "any"
    if isinstance(typ, type):
        return typ.__name__
    return str(typ).replace("typing.", "")


__all__ = ["FRAMEWORK_ARGS", "NONZERO", "Declared", "NoOptions", "check_acts", "declare", "declared", "describe",
           "fit", "options_text", "options_type", "signature_options"]
