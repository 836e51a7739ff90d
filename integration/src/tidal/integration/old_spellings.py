"""Recipe spellings that are gone, refused by name before a recipe is decoded.

Every plugin choice in a recipe has one shape, ``{ name = "...", options = { ... } }`` (issue 32). The
spellings it replaced (a bare name with its options in a sibling field, or a table of name -> options) are
refused here, on the raw TOML and on each dotted override, with the new form in the message: decoding
them would only say "unknown field" or "expects object", and an override into a list that is no longer a
table would fail as "is a value, not a section".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tidal.core.config import apply_overrides
from tidal.core.errors import ConfigError


def refuse_old_spellings(data: dict[str, Any], overrides: Iterable[str], source: str) -> None:
    """Raise a `ConfigError` naming the field and its new form if the recipe `data` (read from `source`) or
    any override spells a plugin choice the old way. Each override is looked at alone, before any is
    applied."""
    _check(data, source)
    for text in overrides:
        _check(apply_overrides({}, [text]), f"override {text!r}")


def _check(data: dict[str, Any], source: str) -> None:
    for field, message in _old(data):
        raise ConfigError(f"{source}: {message}", field=field)


def _old(data: dict[str, Any]):
    """(field, message) for each old spelling in `data`."""
    learner = _section(data, "learner")
    yield from _moved(learner, "backend", "backend_options", "single", "learner.backend",
                      ", e.g. learner.backend.options.optim.lr=1e-5")
    yield from _moved(_section(learner, "weights"), "transport", "options", "zmq", "learner.weights.transport", "")
    rollout = _section(data, "rollout")
    for key, what, example in (("weight_transport", "transport", "zmq"), ("envs", "environment", "countdown")):
        table = rollout.get(key)
        if isinstance(table, dict):  # name -> options
            refs = ", ".join(f"{{ name = \"{n}\", options = {{ ... }} }}" for n in (table or [example]))
            yield (f"rollout.{key}", f"rollout.{key} as a table of {what} name -> options is the old form: write "
                                     f"a list, rollout.{key} = [{refs}]")
    for key, spec in _section(rollout, "domains").items():
        if isinstance(spec, dict):
            yield from _old_env(spec, f"rollout.domains.{key}")
    domains = data.get("domains")
    for i, d in enumerate(domains if isinstance(domains, list) else []):
        if isinstance(d, dict):
            yield from _old_env(d, f"domains[{i}]")


def _moved(section: dict[str, Any], key: str, options_key: str, default: str, field: str, example: str):
    """A plugin named by a bare string at `key` and/or with its options in a sibling `options_key`."""
    value = section.get(key)
    name = value if isinstance(value, str) else default
    at = field.rsplit(".", 1)[0]
    if options_key in section:
        yield (f"{at}.{options_key}",
               f"{at}.{options_key} is gone: write {field} = {{ name = \"{name}\", options = {{ ... }} }} (the "
               f"options moved under {field}.options{example})")
    if isinstance(value, str):
        yield (field, f"{field} = \"{value}\" is the old form: write {field} = {{ name = \"{value}\", options = "
                      f"{{ ... }} }} (as an override: {field}.name=\"{value}\")")


def _old_env(domain: dict[str, Any], at: str):
    env = domain.get("env")
    name = env if isinstance(env, str) else env.get("name", "...") if isinstance(env, dict) else "..."
    new = (f"write {at}.env = {{ name = \"{name}\", options = {{ ... }} }} (the environment's options moved "
           f"under {at}.env.options)")
    if "options" in domain:
        yield (f"{at}.options", f"{at}.options is gone: {new}")
    elif isinstance(env, str):
        yield (f"{at}.env", f"{at}.env = \"{env}\" is the old form: {new}")


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


__all__ = ["refuse_old_spellings"]
