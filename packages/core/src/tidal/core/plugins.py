"""Plugins: pluggy hookspecs for every kind, and the registry that finds implementations by name.

Every package, Tidal's own included, registers through the entry-point group ``tidal``, exactly as a
third party does::

    # pyproject.toml of a plugin distribution
    [project.entry-points.tidal]
    my_env = "my_package.tidal_plugin"

    # my_package/tidal_plugin.py
    from tidal.core.plugins import hookimpl

    @hookimpl
    def tidal_envs():
        return {"my-env": MyEnvironment}     # name -> factory (class or function)

Then anyone asks by name, without importing the package: ``registry.get("env", "my-env")``.
The interface each kind must offer is a `typing.Protocol` in `tidal.core.interfaces`.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from tidal.core.errors import ConfigError, PluginConflict, PluginNotFound
from tidal.core.plugin_failure import PluginBuildError, author_frame, build_failure
from tidal.core.plugin_options import check_acts, declare, declared, fit, options_type

log = logging.getLogger(__name__)

PROJECT = "tidal"
ENTRY_POINT_GROUP = "tidal"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Factory = Callable[..., Any]


class TidalSpecs:
    """One hook per kind. Each returns ``{name: factory}``; the factory builds an implementation of
    the kind's interface (tidal.core.interfaces) from that implementation's config."""

    @hookspec
    def tidal_engines(self) -> Mapping[str, Factory]:
        """Generation engines (`Engine`): e.g. "embedded", "vllm"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_envs(self) -> Mapping[str, Factory]:
        """Environments / tasks that make prompts and verify completions (`Environment`)."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_rewards(self) -> Mapping[str, Factory]:
        """Reward functions usable by any environment (`RewardFn`)."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_tools(self) -> Mapping[str, Factory]:
        """Tools an episode may call (`tidal.core.episodes.Tool`): e.g. "calculator", "python"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_tool_parsers(self) -> Mapping[str, Factory]:
        """Tool-call parsers (`tidal.core.episodes.ToolParser`): e.g. "tags", "json"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_renderers(self) -> Mapping[str, Factory]:
        """Renderers from messages to tokens (`tidal.core.episodes.Renderer`): e.g. "plain", "chat_template"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_advantage_estimators(self) -> Mapping[str, Factory]:
        """Advantage estimators (`AdvantageEstimator`): e.g. "grpo", "rloo", "gae"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_policy_losses(self) -> Mapping[str, Factory]:
        """Policy losses (`PolicyLoss`): e.g. "ppo", "gspo", "cispo"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_admissions(self) -> Mapping[str, Factory]:
        """Admission of stale trajectories, in the buffer (`AdmissionPolicy`, no torch): e.g. "version_rejection"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_corrections(self) -> Mapping[str, Factory]:
        """Off-policy corrections of the loss, in the learner (`CorrectionPolicy`): e.g. "tis", "decoupled_ppo"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_group_filters(self) -> Mapping[str, Factory]:
        """Filters the buffer applies to complete groups (`GroupFilter`): e.g. "zero-variance"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_weight_transports(self) -> Mapping[str, Factory]:
        """Weight transports (`WeightTransport`): e.g. "zmq", "torch_dist", "shm", "fs"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_train_backends(self) -> Mapping[str, Factory]:
        """Training backends (`TrainBackend`): e.g. "single", "fsdp2", "deepspeed"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_opponents(self) -> Mapping[str, Factory]:
        """Opponent samplers of self-play runs: who plays the other seats of each group (e.g. "mirror", "pool")."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")

    @hookspec
    def tidal_launchers(self) -> Mapping[str, Factory]:
        """Launchers that start and watch a run's roles (`Launcher`): e.g. "local", "ray"."""
        raise NotImplementedError("a hook spec: pluggy calls the plugins\' implementations, never this")


# kind name (as users write it in configs and errors) -> hook name
KINDS: dict[str, str] = {
    "engine": "tidal_engines",
    "env": "tidal_envs",
    "reward": "tidal_rewards",
    "tool": "tidal_tools",
    "tool_parser": "tidal_tool_parsers",
    "renderer": "tidal_renderers",
    "advantage_estimator": "tidal_advantage_estimators",
    "policy_loss": "tidal_policy_losses",
    "admission": "tidal_admissions",
    "correction": "tidal_corrections",
    "group_filter": "tidal_group_filters",
    "weight_transport": "tidal_weight_transports",
    "train_backend": "tidal_train_backends",
    "launcher": "tidal_launchers",
    "opponent": "tidal_opponents",
}


# Which Tidal distribution ships the built-in plugins of each kind (for error hints only).
BUILTIN_PROVIDERS: dict[str, str] = {
    "engine": "tidal-rollout",
    "env": "tidal-rollout",
    "reward": "tidal-rollout",
    "tool": "tidal-rollout",
    "tool_parser": "tidal-rollout",
    "renderer": "tidal-rollout",
    "advantage_estimator": "tidal-algos",
    "policy_loss": "tidal-algos",
    "admission": "tidal-staleness",
    "correction": "tidal-staleness",
    "group_filter": "tidal-algos",
    "weight_transport": "tidal-weight-sync",
    "train_backend": "tidal",
    "launcher": "tidal",
    "opponent": "tidal",
}


class Registry:
    """Finds plugin implementations by kind and name. Loads the ``tidal`` entry points on first use.

    A plugin whose import fails does not break the others: its error is kept and shown when a lookup
    misses, so "why is my engine not there" has an answer.
    """

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._load_entry_points = load_entry_points
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        self._table: dict[str, dict[str, tuple[Factory, str]]] | None = None
        self._extra: list[tuple[object, str]] = []
        self.failed: dict[str, str] = {}  # entry point name -> error text

    # ------------------------------------------------------------------ loading

    def _build(self) -> dict[str, dict[str, tuple[Factory, str]]]:
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(TidalSpecs)
        self.failed = {}
        if self._load_entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if pm.has_plugin(ep.name):
                    continue
                try:
                    plugin = ep.load()
                    pm.register(plugin, name=ep.name)
                except Exception as e:  # a broken plugin must not take the others down
                    dist = ep.dist.name if ep.dist else "?"
                    where = author_frame(e.__traceback__, ep.value.split(".")[0].split(":")[0])
                    at = f", at {where}" if where else ""
                    self.failed[ep.name] = f"{type(e).__name__}: {e} (entry point {ep.value!r} of {dist}{at})"
                    log.warning("tidal plugin %r failed to load: %s", ep.name, self.failed[ep.name])
        for plugin, name in self._extra:
            pm.register(plugin, name=name)
        table: dict[str, dict[str, tuple[Factory, str]]] = {kind: {} for kind in KINDS}
        for kind, hook_name in KINDS.items():
            hook = getattr(pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                provided = impl.function() or {}
                for name, factory in dict(provided).items():
                    if name in table[kind]:
                        other = table[kind][name][1]
                        raise PluginConflict(
                            f"{kind} {name!r} is registered by both plugin {other!r} and plugin "
                            f"{impl.plugin_name!r}; uninstall one or rename its {kind}"
                        )
                    table[kind][name] = (factory, impl.plugin_name)
        self._pm = pm
        return table

    def _loaded(self) -> dict[str, dict[str, tuple[Factory, str]]]:
        with self._lock:
            if self._table is None:
                self._table = self._build()
            return self._table

    def reload(self) -> None:
        """Rescan entry points (after installing a plugin into a running process)."""
        with self._lock:
            self._table = None

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object (module or instance with hookimpls) without an entry point. The same
        object registered again under the same name is a no-op."""
        entry: tuple[object, str] = (plugin, name or str(getattr(plugin, "__name__", repr(plugin))))
        with self._lock:
            if any(p is entry[0] and n == entry[1] for p, n in self._extra):
                return
            self._extra.append(entry)
            self._table = None

    # ------------------------------------------------------------------ lookup

    def _kind(self, kind: str) -> dict[str, tuple[Factory, str]]:
        table = self._loaded()
        if kind not in table:
            raise PluginNotFound(f"unknown plugin kind {kind!r}; kinds are: {', '.join(KINDS)}")
        return table[kind]

    def names(self, kind: str) -> list[str]:
        return sorted(self._kind(kind))

    def provider(self, kind: str, name: str) -> str:
        """Name of the plugin (entry point) that registered `name`."""
        self.get(kind, name)
        return self._kind(kind)[name][1]

    def get(self, kind: str, name: str) -> Factory:
        """The factory registered as `name` for `kind`; PluginNotFound lists the registered names."""
        entries = self._kind(kind)
        if name in entries:
            return entries[name][0]
        known = sorted(entries)
        msg = f"no {kind} named {name!r}; registered {kind} names: {', '.join(known) or '(none)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        if self.failed:
            msg += ". Plugins that failed to load: " + "; ".join(f"{k}: {v}" for k, v in self.failed.items())
        elif not known and kind in BUILTIN_PROVIDERS:
            msg += f". Tidal's built-in {kind} plugins come with `pip install {BUILTIN_PROVIDERS[kind]}`"
        raise PluginNotFound(msg)

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Look up `name` and call its factory."""
        return self.get(kind, name)(*args, **kwargs)

    def build(self, kind: str, name: str, options: Mapping[str, Any], *args: Any, field: str = "",
              name_key: str = "name") -> Any:
        """`create` for a plugin chosen in a config section at `field` (its dotted path, e.g.
        ``train.loss`` or ``domains[0]``): an unknown name, or options the factory does not take, raise a
        `ConfigError` that names the plugin and the field (``train.loss.name``, ``train.loss.options``)
        and what exists (the registered names; the options it does take), not a bare error from inside. Any
        other error of the factory (a lazily imported module that is missing) is a `PluginBuildError`
        naming the field, the plugin, its module and distribution, and the author's file and line."""
        at = f"{field}." if field else ""
        factory = self._get_for(kind, name, at, name_key)
        options = self._checked(kind, name, factory, options, at)
        try:
            return factory(*args, **options)
        except ConfigError:
            raise  # already names its field (a tool or parser the plugin builds through this registry)
        except TypeError as e:
            text = str(e)
            if not _BAD_CALL.search(text):
                raise build_failure(kind, name, factory, e, field=field) from e
            takes = _accepted(factory, e)
            hint = f"; it takes: {', '.join(takes)}" if takes else ""
            raise ConfigError(f"{kind} {name!r} does not accept the options at `{at}options` {sorted(options)}: "
                              f"{text}{hint}", field=f"{at}options") from e
        except ValueError as e:  # the factory's own check of a value: building it again would fail again
            raise ConfigError(f"{kind} {name!r} refused the options at `{at}options` {dict(options)}: {e}",
                              field=f"{at}options") from e
        except Exception as e:  # a lazy import that fails, a bug in the constructor: one line, the author's
            raise build_failure(kind, name, factory, e, field=field) from e

    def check(self, kind: str, name: str, options: Mapping[str, Any], *, field: str = "",
              name_key: str = "name") -> dict[str, Any]:
        """What `build` checks before it calls the factory, without building: the name is registered and
        the options fit the plugin's options Struct (`tidal.core.plugin_options`). Returns the options as
        the factory will get them; raises a `ConfigError` naming the field path, the plugin and the
        valid names or fields. The driver runs this over a whole recipe before it starts a process."""
        at = f"{field}." if field else ""
        return self._checked(kind, name, self._get_for(kind, name, at, name_key), options, at)

    def options(self, kind: str, name: str) -> type | None:
        """The options Struct of plugin `name` of `kind`; None when it declares none (unchecked)."""
        return options_type(kind, name, self.get(kind, name))

    def _get_for(self, kind: str, name: str, at: str, name_key: str) -> Factory:
        try:
            return self.get(kind, name)
        except PluginNotFound as e:
            raise ConfigError(f"`{at}{name_key}`: {e}", field=f"{at}{name_key}") from e

    def _checked(self, kind: str, name: str, factory: Factory, options: Mapping[str, Any], at: str) -> dict[str, Any]:
        typ = options_type(kind, name, factory)
        if typ is None:
            return dict(options)
        fitted = fit(options, typ, field=f"{at}options", what=f"{kind} {name!r}")
        check_acts(fitted, typ, declared(factory), field=f"{at}options", what=f"{kind} {name!r}")
        return fitted

    def table(self) -> dict[str, dict[str, str]]:
        """kind -> name -> providing plugin, for listings such as `tidal plugins`."""
        return {kind: {n: p for n, (_, p) in sorted(entries.items())} for kind, entries in self._loaded().items()}


# what Python says when a call's arguments do not fit the function's signature
_BAD_CALL = re.compile(r"unexpected keyword argument|missing \d+ required|takes \d+ positional|"
                       r"takes no keyword|got multiple values for argument|takes no arguments|has no option")


def _accepted(factory: Factory, error: TypeError) -> list[str]:
    """The keyword options of the callable that refused them: the one the TypeError names
    (``Arithmetic.__init__() got an unexpected ...``), looked up where the failing call ran (a lazy
    factory that forwards ``**options``), else the factory itself."""
    target: Any = factory
    named = re.match(r"([A-Za-z_]\w*)(?:\.__init__)?\(\)", str(error))
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if named and tb is not None:
        frame = tb.tb_frame
        target = frame.f_locals.get(named.group(1), frame.f_globals.get(named.group(1), factory))
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


registry = Registry()
"""The process-wide registry, loaded from entry points on first use."""


def get(kind: str, name: str) -> Factory:
    """Shortcut for ``registry.get(kind, name)``."""
    return registry.get(kind, name)


__all__ = ["ENTRY_POINT_GROUP", "KINDS", "PluginBuildError", "Registry", "TidalSpecs", "declare", "get", "hookimpl", "hookspec", "registry"]
