"""Config: TOML files into nested msgspec Structs, with dotted command-line overrides on top.

    class Learner(ConfigStruct):
        lr: float = 1e-6
    class Run(ConfigStruct):
        learner: Learner = msgspec.field(default_factory=Learner)

    cfg = load_config("recipe.toml", Run, overrides=["learner.lr=3e-6"])

Errors name the dotted field, the expected type and what was found, and suggest a near name for a
misspelt key. Each package owns the Structs of its own section; a run's config composes them.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from tidal.core.errors import ConfigError

T = TypeVar("T")


class ConfigStruct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of config sections: keyword-only, unknown keys are errors (a typo never passes silently)."""


class PluginRef(ConfigStruct):
    """A plugin chosen by name, with the keyword arguments of its factory:
    ``admission = { name = "version_rejection", options = { max_lag = 4 } }``."""

    name: str  # registered plugin name (`tidal plugins` lists them)
    options: dict[str, Any] = {}  # keyword arguments of its factory


class Domain(ConfigStruct):
    """One domain of tasks: an environment plugin with its options, a reward plugin that scores its
    samples instead of the env's `score` (optional), its share of the training prompts and a unique name.
    A recipe's `[[domains]]`, a rollout worker's `domains` and an environment process's are lists of it."""

    # environment plugin (`tidal plugins env`) and its factory options: { name = "arithmetic", options = { level = 2 } }
    env: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="arithmetic"))
    weight: float = 1.0  # share of training prompts drawn from this domain (normalised over domains)
    # unique within the recipe; "" = the env's name. Group ids, per-domain metrics and evaluation go by
    # it, so one env can appear twice with different options under two names
    name: str = ""
    # a reward plugin (`tidal plugins reward`) that scores this domain's samples instead of the env's
    # `score`: reward = { name = "exact_match" }
    reward: PluginRef | None = None

    @property
    def key(self) -> str:
        """The name `Assignment.task`, group ids and metrics use: `name`, else the env's name."""
        return self.name or self.env.name


def domains_by_key(domains: Iterable[Domain], field: str = "domains") -> dict[str, Domain]:
    """`domains` by `key`; a key listed twice is refused, naming both places (`domains[i]`)."""
    out: dict[str, Domain] = {}
    where: dict[str, int] = {}
    for i, d in enumerate(domains):
        if d.key in out:
            raise ConfigError(f"{field}[{i}] and {field}[{where[d.key]}] are both named {d.key!r}: give each a "
                              f"unique `name` (e.g. name = \"{d.env.name}-2\"); group ids, metrics and evaluation "
                              f"are keyed by it", field=f"{field}[{i}].name")
        out[d.key], where[d.key] = d, i
    return out


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"learner.lr=1e-6"`` -> (["learner", "lr"], 1e-6). Values use TOML syntax; bare words are strings,
    except the bare word ``none``: no value (None), which unsets an optional field the recipe set
    (``learner.train.correction=none``; TOML has no null, the string is ``'"none"'``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*", key):
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value (e.g. learner.lr=1e-6)")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = None if raw == "none" else raw  # a bare word: `engine.type=vllm`
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set each dotted override into the nested dict `data` (in place; also returned)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"override {text!r}: {where} is a value, not a section", field=where)
            node = child
        node[path[-1]] = value
    return data


def convert(data: Mapping[str, Any], typ: type[T], *, source: str = "config") -> T:
    """Validate a nested dict against Struct type `typ`, with errors that name the dotted field."""
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as e:
        raise _config_error(str(e), typ, source) from None


def read_config(path: str | os.PathLike[str] | None) -> tuple[dict[str, Any], str]:
    """The raw nested dict of the TOML (or JSON, for a `.json` path) at `path` (None: empty), and the name
    errors give its source; for a caller that inspects it before `apply_overrides` and `convert`."""
    if path is None:
        return {}, "defaults"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    if p.suffix == ".json":  # what launchers write for the roles they start
        try:
            data = msgspec.json.decode(p.read_bytes())
        except msgspec.DecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} holds a JSON {type(data).__name__}, not an object of settings")
    else:
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from None
    return data, str(p)


def load_config(
    path: str | os.PathLike[str] | None,
    typ: type[T],
    overrides: Iterable[str] = (),
) -> T:
    """Read TOML (or JSON, for a `.json` path) at `path` (None: defaults only), apply overrides, and
    convert to `typ`."""
    data, source = read_config(path)
    apply_overrides(data, overrides)
    return convert(data, typ, source=source)


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging the effective config of a run)."""
    return msgspec.to_builtins(config)


def _config_error(text: str, root: type, source: str) -> ConfigError:
    m = _PATH.search(text)
    path = m.group("path") if m else ""
    detail = _PATH.sub("", text)
    dotted = re.sub(r"\[(\d+)\]", r"[\1]", path).lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", detail)
    if unknown:
        name = unknown.group(1)
        field = f"{dotted}.{name}" if dotted else name
        known = _fields_at(root, dotted)
        msg = f"{source}: unknown field {field!r}"
        if known:
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
            msg += f" Fields here: {', '.join(known)}"
        return ConfigError(msg, field=field)
    missing = re.match(r"Object missing required field `([^`]+)`", detail)
    if missing:
        field = f"{dotted}.{missing.group(1)}" if dotted else missing.group(1)
        return ConfigError(f"{source}: required field {field!r} is missing", field=field)
    expected = re.match(r"Expected `([^`]+)`, got `([^`]+)`", detail)
    if expected:
        return ConfigError(
            f"{source}: {dotted or 'config'} expects {expected.group(1)}, got {expected.group(2)}", field=dotted
        )
    enum = re.match(r"Invalid enum value (.+)", detail)
    if enum:
        allowed = _literal_values(root, dotted)
        if allowed:
            close = difflib.get_close_matches(enum.group(1).strip("'\""), [str(a) for a in allowed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return ConfigError(f"{source}: {dotted} = {enum.group(1)} is not one of "
                               f"{', '.join(repr(a) for a in allowed)}{hint}", field=dotted)
    return ConfigError(f"{source}: {dotted or 'config'}: {detail}", field=dotted or None)


def _literal_values(root: Any, dotted: str) -> tuple[Any, ...]:
    """The values a `Literal[...]` field at `dotted` takes (() if it is not one, or not found)."""
    parts = [p for p in re.split(r"\.|\[\d+\]", dotted) if p]
    if not parts:
        return ()
    struct = _struct_of(root)
    for part in parts[:-1]:
        if struct is None:
            return ()
        by_name = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
        struct = _struct_of(by_name.get(part))
    if struct is None:
        return ()
    typ = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}.get(parts[-1])
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else ()


def _fields_at(root: Any, dotted: str) -> list[str]:
    typ = root
    for part in [p for p in re.split(r"\.|\[\d+\]", dotted) if p]:
        struct = _struct_of(typ)
        if struct is None:
            return []
        by_name = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
        typ = by_name.get(part)
    struct = _struct_of(typ)
    return [f.encode_name for f in msgspec.structs.fields(struct)] if struct else []


def _struct_of(typ: Any) -> type[msgspec.Struct] | None:
    for t in (typ, *typing.get_args(typ)):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
        for a in typing.get_args(t):  # list[Struct], dict[str, Struct]
            if isinstance(a, type) and issubclass(a, msgspec.Struct):
                return a
    return None


__all__ = ["ConfigStruct", "Domain", "PluginRef", "apply_overrides", "convert", "domains_by_key", "load_config",
           "parse_override", "read_config", "to_dict"]
