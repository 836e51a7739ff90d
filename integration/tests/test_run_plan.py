"""How `tidal run` lays out its roles: the machine's cores shared by load, and every recipe field either
honoured in the roles' configs or refused by name (never silently overridden)."""

import json

import pytest

from tidal.core.errors import ConfigError
from tidal.integration.recipe import load_recipe
from tidal.integration.run import plan, share_threads


def test_cores_are_shared_by_load_and_never_oversubscribed():
    assert share_threads(2, workers=2) == (1, 1)  # the 2-core demo machine: one each, no more
    assert share_threads(16, workers=2) == (8, 4)  # half to the learner, the rest split over workers
    assert share_threads(16, workers=2, learner_ranks=2) == (4, 4)
    assert share_threads(1, workers=3) == (1, 1)  # at least one thread, whatever the machine
    assert share_threads(16, workers=2, fixed=3) == (3, 3)  # launch.threads set: every role gets it
    for cores in (8, 32, 64):  # (with more workers than cores, each still gets one)
        learner, worker = share_threads(cores, workers=3)
        assert learner + 3 * worker <= cores


def test_the_demo_runs_one_worker_on_two_cores_and_two_on_more(tmp_path):
    from tidal.integration.demo import demo_config, demo_workers

    assert [demo_workers(c) for c in (1, 2, 3, 16)] == [1, 1, 2, 2]  # 2 cores: learner + 1 worker, no third process
    assert demo_config(tmp_path, [])[0].workers == demo_workers()  # this machine's
    assert demo_config(tmp_path, [], "tools")[0].workers == 2


@pytest.mark.parametrize("override, names", [
    ("buffer.group_size=4", ["buffer.group_size", "`group_size`"]),
    ("buffer.batch_samples=16", ["buffer.batch_samples", "`batch_groups`"]),
    ("learner.max_steps=7", ["learner.max_steps", "`budget.versions`"]),
    ("learner.train.temperature=0.5", ["learner.train.temperature", "`sampling.temperature`"]),
    ('rollout.controller="tcp://127.0.0.1:1"', ["rollout.controller", "loopback endpoint"]),
    ("sampling.temperature=0", ["sampling.temperature", "greedy"]),
    ("learner.checkpoint_every=-1", ["learner.checkpoint_every"]),
])
def test_a_field_the_run_fills_in_is_refused_when_the_recipe_says_otherwise(tmp_path, override, names):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', override])
    assert all(n in str(e.value) for n in names), str(e.value)
    assert e.value.field == names[0]


def test_what_a_recipe_sets_reaches_the_roles(tmp_path):
    cfg = load_recipe(None, [f'model="{tmp_path}"', "group_size=4", "buffer.group_size=4", 'buffer.wal_dir="my-wal"',
                             "learner.checkpoint_every=0", "sampling.temperature=0.7", "learner.train.temperature=0.7"])
    roles, _ = plan(cfg, tmp_path / "run")
    by = {r.name: json.loads(r.config.read_text()) for r in roles}
    assert by["buffer"]["wal_dir"] == str(tmp_path / "run" / "my-wal") and by["buffer"]["group_size"] == 4
    assert by["learner"]["checkpoint_every"] == 0 and by["learner"]["train"]["temperature"] == 0.7
    default = plan(load_recipe(None, [f'model="{tmp_path}"', "sampling.temperature=0.6"]), tmp_path / "run2")[0]
    learner = next(json.loads(r.config.read_text()) for r in default if r.name == "learner")
    assert learner["checkpoint_every"] == 10 and learner["train"]["temperature"] == 0.6


def test_every_role_gets_the_run_keys_it_needs_and_nothing_more(tmp_path):
    """launch.auth (on by default): one key pair per role in RUN_DIR/keys (owner-only, reused when the
    plan is made again: a resume), each role's `security` with its own secret and the servers it talks to;
    each server lists the roles that may connect; endpoints in the ipc folder when one is given."""
    import stat

    cfg = load_recipe(None, [f'model="{tmp_path}"', "workers=2"])
    run_dir = tmp_path / "run"
    roles, ep = plan(cfg, run_dir, ipc_dir=tmp_path / "ipc")
    assert all(e.startswith(f"ipc://{tmp_path / 'ipc'}/") for e in ep.values())
    keys = run_dir / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in keys.glob("*.key_secret"))
    by = {r.name: json.loads(r.config.read_text()) for r in roles}
    sec = {name: c["security"] for name, c in by.items()}
    assert sec["buffer"]["secret_key"] == str(keys / "buffer.key_secret")
    assert sorted(sec["buffer"]["clients"]) == ["driver", "learner", "rollout-0", "rollout-1"]
    assert sorted(sec["learner"]["servers"]) == ["buffer"]
    assert sorted(sec["learner"]["clients"]) == ["driver", "rollout-0", "rollout-1"]
    assert sorted(sec["rollout-1"]["servers"]) == ["buffer", "driver", "learner"] and not sec["rollout-1"]["clients"]
    assert by["learner"]["weights"]["transport"]["options"]["security"]["secret_key"] == str(keys / "learner.key_secret")
    assert by["learner"]["weights"]["transport"]["options"]["endpoint"] == f"ipc://{tmp_path / 'ipc'}/weights"
    zmq, = (t for t in by["rollout-0"]["weight_transport"] if t["name"] == "zmq")  # listed or not, it gets the keys
    assert zmq["options"]["security"]["servers"]["learner"] == sec["buffer"]["clients"]["learner"]
    before = (keys / "learner.key_secret").read_bytes()
    plan(cfg, run_dir)  # made again (a resume): the same keys
    assert (keys / "learner.key_secret").read_bytes() == before

    off = load_recipe(None, [f'model="{tmp_path}"', "launch.auth=false"])
    roles, ep = plan(off, tmp_path / "plain")
    assert all(e.startswith("tcp://127.0.0.1:") for e in ep.values()) and not (tmp_path / "plain" / "keys").exists()
    assert all(json.loads(r.config.read_text())["security"]["secret_key"] == "" for r in roles)


def test_the_buffer_learns_the_models_vocabulary_size_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1234}))
    roles, _ = plan(load_recipe(None, [f'model="{tmp_path}"']), tmp_path / "run")
    buffer = next(json.loads(r.config.read_text()) for r in roles if r.name == "buffer")
    assert buffer["vocab_size"] == 1234  # the buffer refuses ids outside [0, 1234)
    (tmp_path / "config.json").unlink()  # no config to read: token ids unchecked, not a failure
    roles, _ = plan(load_recipe(None, [f'model="{tmp_path}"']), tmp_path / "run2")
    assert next(json.loads(r.config.read_text()) for r in roles if r.name == "buffer")["vocab_size"] == 0


@pytest.mark.parametrize(("admission", "max_lag"), [
    ('{ name = "version_rejection" }', 3),  # left out: the run's max_staleness
    ('{ name = "version_rejection", options = { max_lag = 1, mode = "mask" } }', 1),  # the recipe's own: kept
])
def test_version_rejection_bounds_lag_by_max_staleness_unless_the_recipe_says(tmp_path, admission, max_lag):
    cfg = load_recipe(None, [f'model="{tmp_path}"', "max_staleness=3", f"buffer.admission={admission}"])
    buffer = next(json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run")[0] if r.name == "buffer")
    assert buffer["admission"]["name"] == "version_rejection" and buffer["admission"]["options"]["max_lag"] == max_lag
    cfg = load_recipe(None, [f'model="{tmp_path}"'])
    assert next(json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run2")[0]
                if r.name == "buffer")["admission"] is None  # none asked for: none made up


def test_the_buffers_ingest_limit_fits_the_largest_group_the_run_can_send(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 160_000, "max_position_embeddings": 32_768}))
    roles, _ = plan(load_recipe(None, [f'model="{tmp_path}"', "sampling.return_sampling_mask=true"]), tmp_path / "r")
    buffer = next(json.loads(r.config.read_text()) for r in roles if r.name == "buffer")
    # 32k tokens x (13 bytes + a 20 kB sampling mask) a sample: far past the 256 MiB default, raised to fit
    assert buffer["max_message_bytes"] >= 32_768 * (13 + 20_000) * buffer["group_size"]
    roles, _ = plan(load_recipe(None, [f'model="{tmp_path}"']), tmp_path / "r2")
    assert next(json.loads(r.config.read_text()) for r in roles if r.name == "buffer")["max_message_bytes"] == 256 * 1024**2


def test_publishing_every_l_steps_needs_a_depth_gate_that_lets_generation_run_l_ahead(tmp_path):
    """Lag by design (learner.weights.every = L): accepted when max_staleness >= L - 1; refused, naming the
    fields and the value to set, when the gate or the buffer's admission would stall or starve the run."""
    cfg = load_recipe(None, [f'model="{tmp_path}"', "learner.weights.every=16", "max_staleness=15"])
    learner = next(json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run")[0] if r.name == "learner")
    assert learner["weights"]["every"] == 16
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', "learner.weights.every=16"])
    assert e.value.field == "max_staleness" and "max_staleness >= 15" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', "learner.weights.every=4", "max_staleness=3",
                           'buffer.admission={ name = "version_rejection", options = { max_lag = 2 } }'])
    assert e.value.field == "buffer.admission.options.max_lag" and ">= 3" in str(e.value)


def test_an_objective_pairing_is_refused_before_any_role_starts_and_none_unsets_a_correction(tmp_path):
    """OAPL with the recipe's correction is refused by `tidal run`'s check, naming the recipe's field; the
    override `learner.train.correction=none` removes the correction the recipe set."""
    oapl = [f'model="{tmp_path}"', 'learner.train.loss={ name = "oapl" }', 'learner.train.advantage={ name = "oapl" }']
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [*oapl, 'learner.train.correction={ name = "tis" }'])
    assert e.value.field == "learner.train.correction" and "remove learner.train.correction" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f'model="{tmp_path}"', 'learner.train.loss={ name = "oapl" }'])
    assert e.value.field == "learner.train.advantage.name"
    cfg = load_recipe(None, [*oapl, 'learner.train.correction={ name = "tis" }', "learner.train.correction=none"])
    assert cfg.learner.train.correction is None


def test_lora_reaches_the_learner_and_the_vllm_engine_and_is_refused_where_it_cannot_train(tmp_path):
    lora = ["learner.lora.rank=4", "learner.lora.alpha=8"]
    cfg = load_recipe(None, [f'model="{tmp_path}"', *lora, 'rollout.engine.name="vllm"'])
    by = {r.name: json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run")[0]}
    assert by["learner"]["lora"]["rank"] == 4 and by["learner"]["lora"]["alpha"] == 8
    assert by["rollout-0"]["engine"]["options"]["lora_rank"] == 4  # vLLM starts with its LoRA support
    with pytest.raises(ConfigError, match="lora_rank = 2 is below learner.lora.rank = 4"):
        plan(load_recipe(None, [f'model="{tmp_path}"', *lora, 'rollout.engine.name="vllm"',
                                "rollout.engine.options.lora_rank=2"]), tmp_path / "run2")
    with pytest.raises(ConfigError, match="'fsdp2' backend") as e:
        plan(load_recipe(None, [f'model="{tmp_path}"', *lora, 'learner.backend.name="fsdp2"']), tmp_path / "run3", 2)
    assert e.value.field == "learner.lora" and "2 learner ranks" in str(e.value)
    embedded = {r.name: json.loads(r.config.read_text())
                for r in plan(load_recipe(None, [f'model="{tmp_path}"', *lora]), tmp_path / "run4")[0]}
    assert "lora_rank" not in embedded["rollout-0"]["engine"]["options"]  # it merges whatever it is sent


def test_selfplay_reaches_the_learner_and_the_workers_and_is_refused_without_a_game(tmp_path):
    from tidal.integration.recipe import recipes_dir

    cfg = load_recipe(recipes_dir() / "selfplay.toml", [f'model="{tmp_path}"', "selfplay.opponent.options.every=3"])
    by = {r.name: json.loads(r.config.read_text()) for r in plan(cfg, tmp_path / "run")[0]}
    snapshots = str(tmp_path / "run" / "snapshots")
    assert by["learner"]["snapshot_every"] == 3 and by["learner"]["snapshot_dir"] == snapshots
    assert by["rollout-0"]["episodes"]["snapshot_dir"] == snapshots
    mirror = load_recipe(recipes_dir() / "selfplay.toml", [f'model="{tmp_path}"', 'selfplay.opponent.name="mirror"',
                                                          "selfplay.opponent.options={}"])
    learner = next(json.loads(r.config.read_text()) for r in plan(mirror, tmp_path / "run2")[0] if r.name == "learner")
    assert learner["snapshot_every"] == 0  # mirror plays no snapshot: none is written
    with pytest.raises(ConfigError, match="no domain is a game") as e:  # arithmetic has one role
        plan(load_recipe(None, [f'model="{tmp_path}"', 'selfplay.opponent.name="pool"']), tmp_path / "run3")
    assert e.value.field == "selfplay.opponent"
    with pytest.raises(ConfigError, match="selfplay.eval_opponent"):
        plan(load_recipe(recipes_dir() / "selfplay.toml", [f'model="{tmp_path}"', 'selfplay.eval_opponent="best"']),
             tmp_path / "run4")
    with pytest.raises(ConfigError, match="snapshot_every") as e:  # the run sets it: never silently overridden
        load_recipe(recipes_dir() / "selfplay.toml", [f'model="{tmp_path}"', "learner.snapshot_every=7"])
