"""TOML configs into Structs; errors name the dotted field; dotted overrides apply on top."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest

from tidal.core import ConfigError
from tidal.core.config import (
    ConfigStruct,
    Domain,
    PluginRef,
    apply_overrides,
    domains_by_key,
    load_config,
    parse_override,
)


class Learner(ConfigStruct):
    lr: float = 1e-6
    steps: int = 100
    loss: str = "ppo"


class Worker(ConfigStruct):
    engine: str = "embedded"
    temperature: float = 1.0
    mode: Literal["async", "sync"] = "async"


class Run(ConfigStruct):
    name: str
    learner: Learner = msgspec.field(default_factory=Learner)
    workers: list[Worker] = []


def write(tmp_path, text):
    p = tmp_path / "recipe.toml"
    p.write_text(text)
    return p


def test_toml_loads_into_nested_structs_with_overrides(tmp_path):
    p = write(tmp_path, 'name = "demo"\n[learner]\nlr = 1e-5\n[[workers]]\ntemperature = 0.7\n')
    cfg = load_config(p, Run, overrides=["learner.lr=3e-6", "learner.loss=gspo", "name=other"])
    assert cfg == Run(name="other", learner=Learner(lr=3e-6, loss="gspo"), workers=[Worker(temperature=0.7)])


@pytest.mark.parametrize(
    ("toml", "overrides", "field", "needle"),
    [
        ('name = "x"\n[learner]\nlr = "fast"\n', [], "learner.lr", "learner.lr expects float, got str"),
        ('name = "x"\n', ["learner.steps=1.5"], "learner.steps", "expects int, got float"),
        ('name = "x"\n[learner]\nlrr = 1\n', [], "learner.lrr", "did you mean 'lr'"),
        ('[learner]\nlr = 1\n', [], "name", "required field 'name' is missing"),
        ('name = "x"\n[[workers]]\ntemperature = "hot"\n', [], "workers[0].temperature", "expects float"),
        ('name = "x"\n', ["name.first=1"], "name", "is a value, not a section"),
        ('name = "x"\n[[workers]]\nmode = "asynch"\n', [], "workers[0].mode",
         "workers[0].mode = 'asynch' is not one of 'async', 'sync'; did you mean 'async'?"),
    ],
)
def test_errors_name_the_dotted_field(tmp_path, toml, overrides, field, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")) as e:
        load_config(write(tmp_path, toml), Run, overrides=overrides)
    assert e.value.field == field
    assert str(tmp_path / "recipe.toml") in str(e.value) or "override" in str(e.value)


def test_bad_files_and_overrides_are_explained(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", Run)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "name = \n"), Run)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        parse_override("learner.lr")


def test_override_values_use_toml_syntax():
    assert parse_override("a.b=1e-6") == (["a", "b"], 1e-6)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("engine=vllm") == (["engine"], "vllm")
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}
    assert parse_override("a.b=none") == (["a", "b"], None)  # unsets an optional field
    assert parse_override('a.b="none"') == (["a", "b"], "none")


def test_json_configs_load_the_same_way_and_a_non_object_is_named(tmp_path):
    p = tmp_path / "role.json"
    p.write_bytes(msgspec.json.encode({"name": "demo", "learner": {"lr": 1e-5}}))
    assert load_config(p, Run, overrides=["learner.steps=3"]) == Run(name="demo", learner=Learner(lr=1e-5, steps=3))
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not an object"):
        load_config(p, Run)
    p.write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(p, Run)


class Domains(ConfigStruct):
    domains: list[Domain] = []


def test_a_domain_is_keyed_by_its_name_else_its_env_and_a_key_listed_twice_is_refused():
    cfg = load_config(None, Domains, ['domains=[{env={name="arithmetic", options={level=2}}}, '
                                      '{name="hard", env={name="arithmetic"}, reward={name="exact_match"}}]'])
    assert [d.key for d in cfg.domains] == ["arithmetic", "hard"]
    assert cfg.domains[0].env == PluginRef(name="arithmetic", options={"level": 2}) and cfg.domains[0].weight == 1.0
    assert list(domains_by_key(cfg.domains)) == ["arithmetic", "hard"]
    assert Domain().env.name == "arithmetic" and Domain().reward is None
    with pytest.raises(ConfigError) as e:
        domains_by_key([*cfg.domains, Domain(name="hard", env=PluginRef(name="countdown"))])
    assert e.value.field == "domains[2].name"
    assert "domains[2] and domains[1] are both named 'hard'" in str(e.value) and 'name = "countdown-2"' in str(e.value)
