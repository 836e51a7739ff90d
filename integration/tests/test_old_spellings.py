"""Every plugin choice in a recipe is `{ name = "...", options = { ... } }` (issue 32): the spellings it
replaced are refused, in a recipe file or as a dotted override, with the field and its new form, before
any process starts; the new forms reach the roles."""

from __future__ import annotations

import json

import pytest

from tidal.core.errors import ConfigError
from tidal.integration.recipe import load_recipe, recipes_dir
from tidal.integration.run import plan

# (old spelling in a recipe file, the field named, what the message must show)
OLD_IN_A_FILE = [
    ('[learner]\nbackend = "fsdp2"\n[learner.backend_options.optim]\nlr = 1e-4\n', "learner.backend_options",
     ["learner.backend_options is gone", 'learner.backend = { name = "fsdp2", options = { ... } }',
      "learner.backend.options"]),
    ('[learner]\nbackend = "fsdp2"\n', "learner.backend",
     ['learner.backend = { name = "fsdp2", options = { ... } }', 'learner.backend.name="fsdp2"']),
    ('[learner.weights]\ntransport = "shm"\n', "learner.weights.transport",
     ['learner.weights.transport = { name = "shm", options = { ... } }']),
    ('[learner.weights]\ntransport = "shm"\noptions = { delta = true }\n', "learner.weights.options",
     ["learner.weights.options is gone", 'learner.weights.transport = { name = "shm", options = { ... } }']),
    ("[rollout.weight_transport]\nzmq = { timeout = 30.0 }\nshm = {}\n", "rollout.weight_transport",
     ['rollout.weight_transport = [{ name = "zmq", options = { ... } }, { name = "shm", options = { ... } }]']),
    ('[[domains]]\nenv = "countdown"\n', "domains[0].env",
     ['domains[0].env = "countdown" is the old form', 'domains[0].env = { name = "countdown", options = { ... } }']),
    ('[[domains]]\nenv = "arithmetic"\noptions = { level = 2 }\n', "domains[0].options",
     ["domains[0].options is gone", 'domains[0].env = { name = "arithmetic", options = { ... } }']),
    ("[rollout.envs]\ncountdown = { max_number = 50 }\n", "rollout.envs",
     ["rollout.envs is gone", '[[domains]] with env = { name = "countdown", options = { ... } }']),
    ('[rollout]\nenvs = [{ name = "reverse", options = { max_len = 8 } }]\n', "rollout.envs",
     ["rollout.envs is gone", '[[domains]] with env = { name = "reverse", options = { ... } }']),
    ('[rollout.domains.extra]\nenv = "reverse"\n', "rollout.domains",
     ["rollout.domains as a table", '[[domains]] with name = "extra", env = { name = "reverse", options = { ... } }']),
    ('[rollout.domains.extra]\nenv = { name = "reverse" }\nreward = { name = "exact_match" }\n', "rollout.domains",
     ["rollout.domains as a table", '[[domains]] with name = "extra", env = { name = "reverse", options = { ... } }',
      "reward = { ... }"]),
]

# (old dotted override, the field named, what the message must show)
OLD_OVERRIDES = [
    ("learner.backend_options.optim.lr=1e-4", "learner.backend_options",
     ["override 'learner.backend_options.optim.lr=1e-4'", "learner.backend_options is gone",
      'learner.backend = { name = "single", options = { ... } }', "learner.backend.options"]),
    ('learner.backend="fsdp2"', "learner.backend", ['learner.backend = { name = "fsdp2", options = { ... } }']),
    ('learner.weights.transport="shm"', "learner.weights.transport",
     ['learner.weights.transport = { name = "shm", options = { ... } }']),
    ("learner.weights.options.delta=true", "learner.weights.options",
     ["learner.weights.options is gone", 'learner.weights.transport = { name = "zmq", options = { ... } }']),
    ("rollout.weight_transport.zmq.timeout=5", "rollout.weight_transport",
     ['rollout.weight_transport = [{ name = "zmq", options = { ... } }]']),
    ("rollout.envs.countdown.max_number=50", "rollout.envs",
     ["rollout.envs is gone", '[[domains]] with env = { name = "countdown", options = { ... } }']),
    ('rollout.envs=[{name="countdown"}]', "rollout.envs",
     ["rollout.envs is gone", '[[domains]] with env = { name = "countdown", options = { ... } }',
      'domains=\'[{env={name="...", options={...}}}]\'']),
    ('rollout.domains.extra.env.name="reverse"', "rollout.domains",
     ['[[domains]] with name = "extra", env = { name = "reverse", options = { ... } }']),
    ('domains=[{env="countdown"}]', "domains[0].env", ['domains[0].env = { name = "countdown", options = { ... } }']),
    ('domains=[{env={name="arithmetic"}, options={level=2}}]', "domains[0].options",
     ["domains[0].options is gone", 'domains[0].env = { name = "arithmetic", options = { ... } }']),
]


@pytest.mark.parametrize(("text", "field", "needles"), OLD_IN_A_FILE, ids=[f for _, f, _ in OLD_IN_A_FILE])
def test_an_old_spelling_in_a_recipe_file_is_refused_with_its_new_form(tmp_path, text, field, needles):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'model = "{tmp_path}"\n{text}')
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe)
    assert e.value.field == field and str(e.value).startswith(f"{recipe}: ")
    assert all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize(("override", "field", "needles"), OLD_OVERRIDES, ids=[o for o, _, _ in OLD_OVERRIDES])
def test_an_old_dotted_override_is_refused_with_its_new_form(tmp_path, override, field, needles):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', override])
    assert e.value.field == field
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_tidal_run_refuses_an_old_spelling_before_anything_starts(tmp_path, monkeypatch, capsys):
    from tidal.integration.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["run", "--check", str(recipes_dir() / "arithmetic.toml"), f'model="{tmp_path}"',
                 "learner.backend_options.optim.lr=1e-4"])
    err = capsys.readouterr().err
    assert code == 2 and "learner.backend_options is gone" in err and "learner.backend = {" in err, err
    assert not list(tmp_path.iterdir()), "a refused recipe made a run folder"


def test_the_new_forms_reach_the_roles_and_their_options_stay_typed(tmp_path):
    cfg = load_recipe(None, [f'model="{tmp_path}"', "learner.backend.options.optim.lr=3e-5",
                             'learner.weights.transport={name="zmq", options={bucket_bytes=1048576}}',
                             'rollout.weight_transport=[{name="zmq", options={timeout=30.0}}, {name="shm"}]',
                             'domains=[{env={name="arithmetic", options={level=2}}}]', "launch.auth=false"])
    assert cfg.learner.backend.name == "single" and cfg.learner.backend.options.optim.lr == 3e-5
    by = {r.name: json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run")[0]}
    assert by["learner"]["backend"]["options"]["optim"]["lr"] == 3e-5
    assert by["learner"]["weights"]["transport"] == {"name": "zmq", "options": {"bucket_bytes": 1048576}}
    assert by["rollout-0"]["weight_transport"] == [{"name": "zmq", "options": {"timeout": 30.0}},
                                                   {"name": "shm", "options": {}}]
    assert [d["env"] for d in by["rollout-0"]["domains"]] == [{"name": "arithmetic", "options": {"level": 2}}]
    with pytest.raises(ConfigError) as e:  # a misspelt backend option is still refused by field
        load_recipe(None, [f'model="{tmp_path}"', 'learner.backend.options.dtyp="bfloat16"'])
    assert e.value.field == "learner.backend.options.dtyp" and "did you mean 'dtype'" in str(e.value)


def test_a_weight_transport_listed_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', 'rollout.weight_transport=[{name="zmq"}, {name="zmq"}]'])
    assert e.value.field == "rollout.weight_transport[1].name" and "'zmq' again" in str(e.value)


def test_the_learner_process_alone_refuses_an_old_spelling_naming_the_new_form(tmp_path):
    """`python -m tidal.integration.learner` reads the [learner] section on its own: the same message."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tidal.integration.learner", f'model="{tmp_path}"',
                          "backend_options.optim.lr=1e-3"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "learner.backend_options is gone" in out.stderr and "learner.backend.options" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("override", ['rollout.domains=[{env={name="countdown"}}]',
                                      'rollout.domains=[{name="extra", env={name="arithmetic"}}]'])
def test_rollout_domains_in_the_new_form_are_refused_unless_they_are_the_top_level_domains(tmp_path, override):
    """The run fills each worker's `rollout.domains` from the top-level `[[domains]]`: a recipe that sets
    other ones is refused, pointing there, never silently overridden."""
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', override, "launch.check_envs=false"])
    assert e.value.field == "rollout.domains"
    assert "the run sets it (from the top-level `[[domains]]`)" in str(e.value), str(e.value)
    assert "list each domain under the top-level `[[domains]]`" in str(e.value)
    same = load_recipe(None, [f'model="{tmp_path}"', 'rollout.domains=[{env={name="arithmetic"}}]',
                              "launch.check_envs=false"])
    assert same.rollout.domains == same.domains  # what the run would set anyway


# config.json of a run folder, as `tidal run` wrote it from recipes/arithmetic.toml at these commits: before
# the one plugin shape (81bcd36) and before the one domain struct (f8d692d)
EARLIER = {"run_config_81bcd36.json": 6, "run_config_f8d692d.json": 2}


@pytest.mark.parametrize("name", sorted(EARLIER))
def test_a_run_folder_written_by_an_earlier_tidal_is_read_with_its_spellings_carried_over(name, caplog, tmp_path):
    from pathlib import Path

    import msgspec

    from tidal.core.config import Domain, PluginRef
    from tidal.integration.recipe import read_recipe

    path = Path(__file__).parent / "recipes" / name
    with pytest.raises(ConfigError, match="is gone"):  # as a recipe someone typed: refused with the new form
        read_recipe(path)
    raw = json.loads(path.read_text())
    with caplog.at_level("WARNING", logger="tidal.recipe"):
        cfg = read_recipe(path, run_folder=True)  # `tidal run --resume` reads it so
    carried = [r.getMessage() for r in caplog.records if "written by an earlier Tidal" in r.getMessage()]
    assert len(carried) == EARLIER[name], carried
    assert cfg.domains == [Domain(env=PluginRef(name="arithmetic", options={"level": 5}))]
    learner = raw["learner"]
    old_optim = (learner["backend_options"] if "backend_options" in learner else learner["backend"]["options"])["optim"]
    assert cfg.learner.backend.name == "single" and cfg.learner.backend.options.optim.lr == old_optim["lr"]
    assert cfg.learner.weights.transport.name == "zmq" and cfg.rollout.domains == []
    # what the resumed run writes back to config.json is the new form: read again, nothing is carried over
    again = tmp_path / "config.json"
    again.write_bytes(msgspec.json.encode(cfg))
    assert read_recipe(again) == cfg
