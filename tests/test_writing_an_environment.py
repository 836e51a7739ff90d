"""What an environment author gets for the common mistakes (issue "Writing an environment"), tried with an
outside package (tests/outside/tidal-env-unitconv: a multi-turn unit conversion with two tool plugins)
installed beside the whole of Tidal in a fresh venv, trained on by `tidal run` with a tiny model:

- a module that fails to import inside its factory is refused before any process starts, naming the
  recipe field, the plugin and the author's file and line;
- a tool that hangs costs one episode within `step_timeout_s` and a bounded grace (its stack in the
  environment log), a tool that floods 50 MB is truncated in the environment process, and neither
  restarts the worker; the run ends within its time budget plus a minute; `tidal samples` shows what
  the model wrote, turn by turn;
- `outcome()` returning NaN, None, "wrong" or "1.0" is never a reward: the run, unable to train, ends
  `failed` with the cause, and the evaluation that scored nothing reports no accuracy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fresh_tidal import PREPARE, env_logs, tidal_run, tidal_venv

OUTSIDE = Path(__file__).parent / "outside" / "tidal-env-unitconv"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(python, work folder, model): the fresh venv with Tidal and the outside package, and a tiny model."""
    tmp = tmp_path_factory.mktemp("outside")
    py = tidal_venv(tmp, OUTSIDE)
    model = tmp / "model"
    out = subprocess.run([py, "-c", PREPARE, str(model), "unitconv"], capture_output=True, text=True, timeout=300,
                         cwd=tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["tidal-env-unitconv"]
    return py, tmp, model


def common(model: Path) -> list[str]:
    return [f'model="{model}"', 'monitor.progress="log"', "monitor.tensorboard=false", "workers=1",
            "sampling.max_tokens=8", "eval.every=1000", "eval.size=8", "rollout.episodes.max_tokens=120",
            "rollout.episodes.processes=2"]


def scalars(run_dir: Path, source: str) -> dict[str, float]:
    """The last row of `source` in metrics.jsonl, merged over every row (counters only grow)."""
    out: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["source"] == source:
            out.update(row["scalars"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_module_that_fails_to_import_in_its_factory_is_refused_before_launch(venv):
    py, tmp, model = venv
    run_dir = tmp / "lazy"
    rc, out, seconds = tidal_run(py, tmp, run_dir, *common(model),
                                 'domains=[{env={name="unitconv", options={backend="pint"}}}]', timeout=120)
    assert rc != 0, out[-3000:]
    assert "domains" in out and "'unitconv'" in out and "unitconv_tidal" in out, out[-3000:]
    assert "No module named 'pint'" in out and "pint_backend.py:" in out, out[-3000:]
    assert seconds < 60, f"refused after {seconds:.0f} s"
    logs = run_dir / "logs"
    started = sorted(p.name for p in logs.glob("*.log") if p.name != "driver.log") if logs.is_dir() else []
    assert started == [], f"processes started before the refusal: {started}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tool_that_hangs_or_floods_costs_one_episode_and_the_worker_lives(venv):
    py, tmp, model = venv
    run_dir = tmp / "faulty-tools"
    tools = "tools={unit_factor={hang_every=15, flood_every=5, flood_mb=50}}"
    # a hang costs its episode alone when the group may train on its survivors (the default, drop_group,
    # would lose the group: a group of 8 untrained episodes meets a hang more often than not)
    rc, out, seconds = tidal_run(py, tmp, run_dir, *common(model), f'domains=[{{env={{name="unitconv", options={{{tools}}}}}}}]',
                                 "budget.versions=10000", "budget.minutes=1", "rollout.episodes.step_timeout_s=3",
                                 'rollout.episodes.on_error="survivors"', "group_size=4", "batch_groups=2",
                                 "launch.fail_without_signal=false")  # untrained: checks the tools, not learning
    assert rc == 0, out[-4000:] + env_logs(run_dir)
    assert seconds < 60 + 60 + 10, f"a 1-minute budget took {seconds:.0f} s"
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["versions"] > 0, final
    assert final["restarts"] == {}, final  # the worker never went silent
    worker = scalars(run_dir, "rollout-0")
    assert worker["rollout/envpool/timeouts"] >= 1, worker
    assert worker["rollout/groups/trained_on_survivors"] >= 1, worker  # the hang cost an episode, not its group
    assert worker["rollout/episodes/info/observations_truncated"] >= 1, worker
    env_log = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("rollout-0-env-*.log"))
    assert "unitconv_tidal/tools.py" in env_log and "in run" in env_log, env_log[-3000:]  # the stuck call's stack

    shown = subprocess.run([py, "-m", "tidal.integration.cli", "samples", str(run_dir), "-n", "3"], capture_output=True,
                           text=True, timeout=60, cwd=tmp)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "Convert" in shown.stdout and "unit_factor" in shown.stdout, shown.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rewards_that_are_not_numbers_are_never_trained_on_and_the_run_fails_with_the_cause(venv):
    py, tmp, model = venv
    run_dir = tmp / "bad-rewards"
    rc, out, seconds = tidal_run(py, tmp, run_dir, *common(model),
                                 'domains=[{env={name="unitconv", options={outcome_fault="mixed"}}}]', "budget.versions=10",
                                 "budget.minutes=4", "launch.no_trainable_group_s=20", timeout=400)
    assert seconds < 150, f"a run that could not train took {seconds:.0f} s to say so"
    final = json.loads((run_dir / "final.json").read_text())
    status = final["status"]
    assert rc != 0 and status.startswith("failed: no group could be scored"), (status, out[-3000:])
    assert "outcome()" in status and "unitconv_tidal/env.py:" in status, status
    assert final["versions"] == 0, final
    worker = scalars(run_dir, "rollout-0")
    assert worker["rollout/envpool/verifier_errors"] >= 4, worker
    env_log = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("rollout-0-env-*.log"))
    for shown in ("nan", "None", "'wrong'", "'1.0'"):  # each type's first occurrence, with its value
        assert shown in env_log, (shown, env_log[-4000:])
    assert not any("eval/accuracy" in json.loads(line)["scalars"]
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()), "an unscored eval got an accuracy"
