"""Recipe spellings that are gone, refused by name before a recipe is decoded.

Every plugin choice in a recipe has one shape, ``{ name = "...", options = { ... } }``, and every domain
is one entry of the top-level ``[[domains]]`` (issue 32). The spellings they replaced (a bare name with its
options in a sibling field, a table of name -> options, ``rollout.envs``, ``rollout.domains`` as a table)
are refused here, on the raw TOML and on each dotted override, with the new form in the message: decoding
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
    table = rollout.get("weight_transport")
    if isinstance(table, dict):  # name -> options
        refs = ", ".join(f"{{ name = \"{n}\", options = {{ ... }} }}" for n in (table or ["zmq"]))
        yield ("rollout.weight_transport", f"rollout.weight_transport as a table of transport name -> options is "
                                           f"the old form: write a list, rollout.weight_transport = [{refs}]")
    if "envs" in rollout:
        yield ("rollout.envs", f"rollout.envs is gone: every environment is a domain of the run, listed once at the "
                               f"top level: write {_as_domains(_env_names(rollout['envs']))} (as an override: "
                               f"domains='[{{env={{name=\"...\", options={{...}}}}}}]')")
    old = rollout.get("domains")
    if isinstance(old, dict):  # domain name -> { env, reward }
        listed = [(k, _env_name(v.get("env")) if isinstance(v, dict) else "...") for k, v in old.items()]
        yield ("rollout.domains", f"rollout.domains as a table of domain name -> {{ env, reward }} is the old form, "
                                  f"and the run now fills rollout.domains from the top-level list: write "
                                  f"{_as_domains(listed or [('', 'countdown')])} (with its reward = {{ ... }}, if "
                                  f"any) instead")
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


def _env_name(env: Any) -> str:
    """The environment plugin an old or new `env` value names ("..." when it names none)."""
    return env if isinstance(env, str) else str(env.get("name", "...")) if isinstance(env, dict) else "..."


def _env_names(envs: Any) -> list[tuple[str, str]]:
    """("", env name) for each environment of an old `rollout.envs`: a table of name -> options or a list."""
    names = list(envs) if isinstance(envs, dict) else [_env_name(e) for e in envs] if isinstance(envs, list) else []
    return [("", str(n)) for n in names] or [("", "countdown")]


def _as_domains(listed: list[tuple[str, str]]) -> str:
    """The top-level `[[domains]]` tables of (domain name, env name) pairs ("" name: the env's own), as a
    message writes them."""
    tables = []
    for name, env in listed:
        named = f"name = \"{name}\", " if name and name != env else ""
        tables.append(f"[[domains]] with {named}env = {{ name = \"{env}\", options = {{ ... }} }}")
    return "; ".join(tables)


def _old_env(domain: dict[str, Any], at: str):
    env = domain.get("env")
    name = _env_name(env)
    new = (f"write {at}.env = {{ name = \"{name}\", options = {{ ... }} }} (the environment's options moved "
           f"under {at}.env.options)")
    if "options" in domain:
        yield (f"{at}.options", f"{at}.options is gone: {new}")
    elif isinstance(env, str):
        yield (f"{at}.env", f"{at}.env = \"{env}\" is the old form: {new}")


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def migrate_run_config(data: dict[str, Any]) -> list[str]:
    """Rewrite, in place, the old spellings in a run folder's `config.json` that an earlier Tidal wrote
    (a resumed run's recipe was never typed by the user, so it is carried over rather than refused); what
    was rewritten, one line each. What cannot be carried over unchanged (a non-empty `rollout.domains`
    table, which overrode the top-level domains in the workers only) stays, and is refused as usual."""
    done: list[str] = []
    learner = _section(data, "learner")
    for section, key, options_key, default, field in ((learner, "backend", "backend_options", "single", "learner.backend"),
                                                      (_section(learner, "weights"), "transport", "options", "zmq",
                                                       "learner.weights.transport")):
        if isinstance(section.get(key), str) or options_key in section:
            name = section[key] if isinstance(section.get(key), str) else default
            section[key] = {"name": name, "options": section.pop(options_key, {})}
            done.append(f"{field} = {{ name = \"{name}\", options = {{ ... }} }}")
    rollout = _section(data, "rollout")
    if isinstance(rollout.get("weight_transport"), dict):
        rollout["weight_transport"] = [{"name": n, "options": o} for n, o in rollout["weight_transport"].items()]
        done.append("rollout.weight_transport as a list")
    if "envs" in rollout:  # a run's tasks are its domains': environments listed only here were never asked for
        rollout.pop("envs")
        done.append("rollout.envs dropped (a run's tasks come from [[domains]])")
    if rollout.get("domains") == {}:
        rollout.pop("domains")
        done.append("rollout.domains dropped (the run fills it from [[domains]])")
    domains = data.get("domains")
    for i, d in enumerate(domains if isinstance(domains, list) else []):
        if isinstance(d, dict) and (isinstance(d.get("env"), str) or "options" in d):
            d["env"] = {"name": _env_name(d.get("env")), "options": d.pop("options", {})}
            done.append(f"domains[{i}].env = {{ name = \"{d['env']['name']}\", options = {{ ... }} }}")
    return done


__all__ = ["migrate_run_config", "refuse_old_spellings"]
