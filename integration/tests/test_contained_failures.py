"""What an outside plugin author's mistakes do to a whole run (`tidal run`, every role a real process,
the plugins installed as a third-party distribution on the roles' path): never a hang, never a silent
wrong result, always an error that names the cause.

- an env whose `score()` raises for about one sample in ten, one worker, evaluation on: the run finishes,
  the dropped groups are counted by reason, the traceback is logged once; the same env twice under two
  domain names with different options, each scored by its own instance and evaluated under its own name;
  a domain scored by a reward plugin instead of its env; `score()` sees the prompt;
- task metadata that is not text: the run fails at once with the plugin and the field named;
- an env that can never score: the run ends "stalled" with the worker's error, within its stall timeout;
- a misspelt loss name and a bad env option: the run fails once (no restarts) with the role's own
  message, naming the field path.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


ACME = '''
import zlib

from tidal.core.interfaces import Task
from tidal.core.plugins import hookimpl
from tidal.rollout.envs.tasks import Arithmetic


class Flaky:
    """Arithmetic whose verifier crashes on about one completion in `fail_one_in`; it insists on seeing
    the prompt it made and on scoring only its own tasks (tagged)."""

    def __init__(self, level=1, tag="", fail_one_in=10):
        self.inner, self.tag, self.fail_one_in = Arithmetic(level=level), tag, fail_one_in

    def tasks(self, split, seed):
        for t in self.inner.tasks(split, seed):
            yield Task(prompt=t.prompt, answer=t.answer, domain="acme-" + self.tag, metadata={"tag": self.tag})

    def score(self, task, completion):
        if not task.prompt:
            raise LookupError("score() was given a task without its prompt")
        if task.metadata.get("tag") != self.tag or task.domain != "acme-" + self.tag:
            raise LookupError(f"the {self.tag!r} instance was asked to score {task.metadata} / {task.domain}")
        if self.fail_one_in and zlib.crc32((task.prompt + completion).encode()) % self.fail_one_in == 0:
            raise RuntimeError("acme verifier crashed")
        return self.inner.score(task, completion)


class IntMeta(Arithmetic):
    def tasks(self, split, seed):
        for t in super().tasks(split, seed):
            yield Task(prompt=t.prompt, answer=t.answer, metadata={"level": 3})


def exact(task, completion):
    return float(completion.split("\\n", 1)[0].strip() == task.answer)


@hookimpl
def tidal_envs():
    return {"acme-flaky": Flaky, "acme-intmeta": IntMeta}


@hookimpl
def tidal_rewards():
    return {"acme-exact": lambda: exact}


def acme_pg(strength: float = 1.0):
    """A loss whose factory refuses a value that its options' type allows: only the learner finds out."""
    if strength <= 0:
        raise ValueError(f"strength must be > 0, got {strength}")
    raise AssertionError("never built in these tests")


@hookimpl
def tidal_policy_losses():
    return {"acme-pg": acme_pg}
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model (no warm start: these runs test failures, not learning) and the acme plugin
    distribution on a path entry that every role inherits."""
    from tidal.rollout.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("contained")
    model = build_tiny_model(root / "model", seed=0)
    site = root / "site"
    site.mkdir()
    (site / "acme_tidal.py").write_text(ACME)
    info = site / "acme_tidal-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tidal\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tidal]\nacme = acme_tidal\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return model, env


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def test_a_crashing_verifier_costs_its_groups_not_the_run(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    domains = ('domains=[{name="easy", env={name="acme-flaky", options={level=1, tag="easy"}}},'
               ' {name="hard", env={name="acme-flaky", options={level=2, tag="hard"}}},'
               ' {name="graded", env={name="acme-flaky", options={level=1, tag="graded", fail_one_in=1}},'
               ' reward={name="acme-exact"}}]')
    rc, out = tidal_cli.run(world, run_dir, "workers=1", domains, "budget.versions=6", "eval.every=3", "eval.size=30",
                           "sampling.max_tokens=4")
    assert rc == 0, out[-4000:] + tidal_cli.logs(run_dir)
    f = final(run_dir)
    assert f["status"] == "completed" and f["versions"] == 6 and f["restarts"] == {}
    # evaluation at 0, 3 and 6, each under every domain's own name; a problem whose verifier crashed is
    # counted as failed, never as a zero reward
    assert [e[0] for e in f["eval"]] == [0, 3, 6]
    assert all(set(e[2]) == {"easy", "hard", "graded"} for e in f["eval"]), f["eval"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m["scalars"] for m in metrics if "eval/accuracy" in m["scalars"]]
    from tidal.rollout.envs.tasks import Arithmetic, first_tasks

    held_out = sum(len(first_tasks(Arithmetic(level=lv), "eval", seed, 30)) for seed, lv in enumerate((1, 2, 1)))
    assert evals and all(e["eval/problems"] + e["eval/failed"] == held_out for e in evals), evals
    assert any(e["eval/failed"] > 0 for e in evals)
    # dropped training groups counted by reason, on the worker and at the controller
    ctl = f["controller"]
    assert ctl["controller/groups_dropped/score_error"] > 0 and ctl["controller/groups_done"] > 0
    assert "controller/groups_dropped/reward_error" not in ctl  # the reward plugin never failed
    assert set(k for k in ctl if k.startswith("controller/groups_dropped/")) == {"controller/groups_dropped/score_error"}
    worker = [m["scalars"] for m in metrics if m["source"] == "rollout-0" and "rollout/groups/done" in m["scalars"]]
    assert worker[-1].get("rollout/groups/dropped/score_error", 0) > 0
    # the traceback once; no sample was scored without its prompt or by the other domain's instance
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert len(re.findall(r"^RuntimeError: acme verifier crashed$", log, re.M)) == 1, log[-3000:]
    assert log.count("Traceback") == 1 and "LookupError" not in log


def test_task_metadata_that_is_not_text_fails_the_run_naming_plugin_and_field(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run(world, run_dir, "workers=1", 'domains=[{env={name="acme-intmeta", options={level=1}}}]', "eval.every=0",
                              timeout=240)
    assert rc == 1, out[-3000:]
    status = final(run_dir)["status"]
    assert status.startswith("failed:") and "'acme-intmeta'" in status and "domains[0]" in status, status
    assert "metadata['level'] = 3 (int)" in status and "dict[str, str]" in status
    assert "metadata['level'] = 3 (int)" in out  # on the driver's own output, not only in a file


def test_an_env_that_can_never_score_ends_the_run_as_stalled_with_its_error(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run(world, run_dir, "workers=1", 'domains=[{env={name="acme-flaky", options={fail_one_in=1}}}]',
                              "eval.every=0", "launch.stall_timeout_s=20", timeout=300)
    assert rc == 1, out[-3000:]
    f = final(run_dir)
    assert f["status"].startswith("stalled: no new policy version for"), f["status"]
    assert "acme verifier crashed" in f["status"] and "score_error" in f["status"]
    assert f["versions"] == 0 and "rollout-0" in f["errors"]
    assert "stalled" in out


def test_a_loss_option_only_its_factory_can_judge_is_refused_before_any_role_starts(world, tmp_path, tidal_cli):
    """A misspelt loss name is refused by the driver before any role starts (test_plugin_checks.py); so is a
    value only the plugin's factory can judge: `tidal run`'s check builds the objective as the learner would
    (recipe._check_objective), and its message names the recipe's field. No run folder, no role."""
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run(world, run_dir, "workers=1", 'learner.train.loss={name="acme-pg", options={strength=-1.0}}', timeout=240)
    assert rc == 2, out[-3000:]
    assert "`learner.train.loss.options`" in out and "strength must be > 0" in out, out[-3000:]
    assert "Traceback" not in out
    assert not run_dir.exists()


def test_a_bad_env_option_is_refused_before_any_role_starts(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run(world, run_dir, "workers=1", 'domains=[{env={name="arithmetic", options={levl=2}}}]', timeout=120)
    assert rc == 2, out[-3000:]
    assert "`domains[0].env.options.levl`" in out and "did you mean 'level'" in out and "it takes: level" in out
    assert "Traceback" not in out
    assert not run_dir.exists()  # refused while the recipe is read: no role started, no run folder made
