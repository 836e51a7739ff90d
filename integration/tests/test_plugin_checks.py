"""`tidal run` checks every plugin a recipe names before it starts a process: for each plugin kind, a
misspelt option names its field path and the options the plugin takes, and an unknown plugin name
lists the registered ones. Run through the CLI's own entry point (in this process: each case is a
recipe refused in well under a second) and once as the real command, and each time the run folder
shows that no role was started.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tidal.integration.cli import main

RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("checks") / "model", seed=0)


# (plugin kind, override with a misspelt option, what the error must say)
MISSPELT = [
    ("env", "domains=[{env={name='arithmetic', options={levl=2}}}]",
     ["`domains[0].env.options.levl`", "env 'arithmetic'", "did you mean 'level'", "eval_size: int = 200"]),
    ("env value type", "domains=[{env={name='arithmetic', options={level='hard'}}}]",
     ["`domains[0].env.options.level`", "Expected `int | array`, got `str`"]),
    ("reward", "domains=[{env={name='arithmetic'}, reward={name='exact_match', options={strict=true}}}]",
     ["`domains[0].reward.options.strict`", "reward 'exact_match'", "no options"]),
    ("engine", "rollout.engine={name='embedded', options={max_num_seq=8}}",
     ["`rollout.engine.options.max_num_seq`", "engine 'embedded'", "did you mean 'max_num_seqs'"]),
    ("policy_loss", "learner.train.loss={name='ppo', options={clip_hi=0.3}}",
     ["`learner.train.loss.options.clip_hi`", "policy_loss 'ppo'", "clip_high: float = 0.2"]),
    ("advantage_estimator", "learner.train.advantage={name='grpo', options={epsilon=0.1}}",
     ["`learner.train.advantage.options.epsilon`", "advantage_estimator 'grpo'", "eps: float"]),
    ("correction", "learner.train.correction={name='tis', options={cpa=2.0}}",
     ["`learner.train.correction.options.cpa`", "did you mean 'cap'"]),
    ("admission", "buffer.admission={name='version_rejection', options={max_lags=2}}",
     ["`buffer.admission.options.max_lags`", "did you mean 'max_lag'"]),
    ("group_filter", "buffer.filters=[{name='zero_variance', options={tolerance=0.1}}]",
     ["`buffer.filters[0].options.tolerance`", "group_filter 'zero_variance'", "tol: float"]),
    ("weight_transport (sender)", "learner.weights.transport={name='zmq', options={bucket_byte=1024}}",
     ["`learner.weights.transport.options.bucket_byte`", "did you mean 'bucket_bytes'"]),
    ("weight_transport (receiver)", "rollout.weight_transport=[{name='zmq', options={timeot=5}}]",
     ["`rollout.weight_transport[0].options.timeot`", "its receiver", "did you mean 'timeout'"]),
    ("train_backend", "learner.backend.options.dtyp='float32'", ["learner.backend.options.dtyp", "dtype"]),
    ("launcher", "launcher={name='ray', options={adress='auto'}}",
     ["`launcher.options.adress`", "launcher 'ray'", "did you mean 'address'"]),
    ("renderer", "rollout.episodes.renderer={name='plain', options={separatr='x'}}",
     ["`rollout.episodes.renderer.options.separatr`", "renderer 'plain'", "did you mean 'separator'"]),
    ("tool (an episodic env's)", "domains=[{env={name='multiply', options={calculator={max_lenght=40}}}}]",
     ["`domains[0].env.options`", "`tools.calculator.options.max_lenght`", "tool 'calculator'",
      "did you mean 'max_length'"]),
]

# (plugin kind, override with an unknown name, what the error must say)
UNKNOWN = [
    ("env", "domains=[{env={name='arithmatic'}}]", ["`domains[0].env.name`", "no env named 'arithmatic'", "countdown",
                                              "Did you mean 'arithmetic'"]),
    ("reward", "domains=[{env={name='arithmetic'}, reward={name='exact'}}]", ["`domains[0].reward.name`", "exact_match"]),
    ("engine", "rollout.engine.name='vllm2'", ["`rollout.engine.name`", "no engine named 'vllm2'", "embedded"]),
    ("policy_loss", "learner.train.loss.name='ppp'", ["`learner.train.loss.name`", "Did you mean 'ppo'"]),
    ("advantage_estimator", "learner.train.advantage.name='gea'", ["`learner.train.advantage.name`", "gae"]),
    ("correction", "learner.train.correction={name='tiss'}", ["`learner.train.correction.name`", "seq_tis"]),
    ("correction named as admission", "buffer.admission={name='tis'}", ["`buffer.admission.name`", "no admission named 'tis'",
                                                                         "version_rejection"]),
    ("admission", "buffer.admission={name='version_reject'}", ["`buffer.admission.name`", "version_rejection"]),
    ("group_filter", "buffer.filters=[{name='zero_var'}]", ["`buffer.filters[0].name`", "zero_variance"]),
    ("weight_transport", "learner.weights.transport.name='zmqq'", ["`learner.weights.transport.name`", "torch_dist"]),
    ("weight_transport (receiver)", "rollout.weight_transport=[{name='nccl'}]", ["`rollout.weight_transport[0].name`",
                                                                          "torch_dist"]),
    ("train_backend", "learner.backend.name='fsdp'", ["`learner.backend.name`", "Did you mean 'fsdp2'"]),
    ("launcher", "launcher.name='slurm'", ["`launcher.name`", "no launcher named 'slurm'", "local"]),
    ("renderer", "rollout.episodes.renderer.name='chatml'", ["`rollout.episodes.renderer.name`",
                                                             "no renderer named 'chatml'", "chat_template"]),
]


def _refused(model: Path, run_dir: Path, override: str, capsys, *more: str) -> str:
    rc = main(["run", str(RECIPE), f'model="{model}"', f'run_dir="{run_dir}"', override, *more])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not run_dir.exists(), "a refused recipe must not start anything (its run folder exists)"
    return err


@pytest.mark.parametrize(("kind", "override", "says"), MISSPELT, ids=[m[0] for m in MISSPELT])
def test_a_misspelt_option_is_refused_before_any_process_starts(model, tmp_path, capsys, kind, override, says):
    err = _refused(model, tmp_path / "run", override, capsys)
    for text in says:
        assert text in err, f"{text!r} not in: {err}"


@pytest.mark.parametrize(("kind", "override", "says"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_an_unknown_plugin_name_is_refused_listing_the_registered_ones(model, tmp_path, capsys, kind, override, says):
    err = _refused(model, tmp_path / "run", override, capsys)
    for text in says:
        assert text in err, f"{text!r} not in: {err}"


REMAX = "learner.train.advantage={name='remax'}"


@pytest.mark.parametrize(("override", "says"), [
    ("group_size=1", ["`group_size` = 1 with advantage 'remax'", "one greedy baseline", "at least 2"]),
    ("domains=[{env={name='multiply'}}]", ["domains[0] ('multiply') is multi-turn", "no greedy baseline member",
                                           "choose another learner.train.advantage"]),
], ids=["group of one", "multi-turn domain"])
def test_remax_without_room_for_its_greedy_member_is_refused(model, tmp_path, capsys, override, says):
    err = _refused(model, tmp_path / "run", REMAX, capsys, override)
    for text in says:
        assert text in err, f"{text!r} not in: {err}"


def test_the_command_itself_refuses_with_exit_2_and_no_traceback(model, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "run", str(RECIPE), f'model="{model}"',
                           f'run_dir="{run_dir}"', "learner.train.loss={name='ppo', options={clip_hi=0.3}}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "`learner.train.loss.options.clip_hi`" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not run_dir.exists()


NO_TASKS = """
from tidal.core.plugins import hookimpl


class NoTasks:
    def tasks(self, split, seed):
        rows = {}
        yield rows["first"]  # the author's bug: reached only when the first task is drawn

    def score(self, task, completion):
        return 0.0


@hookimpl
def tidal_envs():
    return {"no_tasks": NoTasks}
"""


def test_an_env_that_cannot_make_its_first_task_is_refused_before_any_process_starts(model, tmp_path, capsys,
                                                                                    monkeypatch):
    from tidal.integration.recipe import load_recipe

    (tmp_path / "acme_no_tasks.py").write_text(NO_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = ["rollout.episodes.plugins=['acme_no_tasks']", "domains=[{env={name='no_tasks'}}]"]
    rc = main(["run", str(RECIPE), f'model="{model}"', f'run_dir="{tmp_path / "run"}"', *recipe])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "run").exists(), err
    assert ("domains[0].env: environment plugin 'no_tasks' (module acme_no_tasks) failed to make its first train task: "
            "KeyError: 'first' (acme_no_tasks.py:8)") in err, err
    # launch.check_envs = false: the pre-flight is skipped (the controller meets the error instead)
    assert load_recipe(RECIPE, [f'model="{model}"', *recipe, "launch.check_envs=false"]).launch.check_envs is False


EMPTY = """
from tidal.core.plugins import hookimpl


class Empty:
    def tasks(self, split, seed):
        return iter(())

    def score(self, task, completion):
        return 0.0


@hookimpl
def tidal_envs():
    return {"empty": Empty}
"""


def test_an_env_whose_train_stream_is_empty_is_refused_naming_the_domain(model, tmp_path, capsys, monkeypatch):
    (tmp_path / "acme_empty.py").write_text(EMPTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["run", str(RECIPE), f'model="{model}"', f'run_dir="{tmp_path / "run"}"',
               "rollout.episodes.plugins=['acme_empty']", "domains=[{env={name='empty'}}]"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "run").exists(), err
    assert "domains[0]: env 'empty' made no train task" in err, err
