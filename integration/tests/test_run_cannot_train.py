"""A run that cannot train says so: the controller counts a group trained on its survivors apart from its
left-out samples (never delivered), a run whose groups are all dropped ends `failed` with its top cause,
a drop rate above `launch.max_drop_rate` is a warning and an event, and an evaluation that scored nothing
has no accuracy. The controller runs against real sockets; the driver's watch is its own code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tidal.core.channels import dealer
from tidal.core.protocol import Ack, Heartbeat, Metrics, WorkRequest
from tidal.integration.controller import Controller
from tidal.integration.recipe import load_recipe
from tidal.integration.supervisor import Stop, Supervisor
from tidal.rollout.tiny import build_char_tokenizer
from tidal.rollout.worker.process import EVAL_KEY

RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"
NAN = "outcome() returned nan (float), not a real number (env unitconv, unitconv_tidal/env.py:82)"


def _controller(tmp_path: Path, rows: list[Metrics], *overrides: str) -> Controller:
    cfg = load_recipe(RECIPE, [f"model=\"{tmp_path}\"", *overrides])
    return Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                      buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                      emit=rows.append)


def _step_until(ctl: Controller, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the controller did not get there in time"
        ctl.step(0.02)


def test_left_out_samples_are_settled_but_never_counted_delivered(tmp_path):
    ctl = _controller(tmp_path, [], "eval.every=0")
    worker = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        worker.send(WorkRequest(want=3, version=0))
        _step_until(ctl, lambda: "rollout-0" in ctl.workers and ctl.counts["groups_granted"] == 3)
        a = [worker.recv(timeout=5) for _ in range(3)]
        g = a[0].num_samples
        assert ctl.gate.state.in_flight == 3 * g
        worker.send(Ack(kind="assignment", ids=[a[0].group_id], left_out=2, detail=NAN))
        worker.send(Ack(kind="assignment", ids=[a[1].group_id]))
        worker.send(Ack(kind="assignment", ids=[a[2].group_id], ok=False, reason="verifier_error", detail=NAN))
        _step_until(ctl, lambda: ctl.gate.state.in_flight == 0)
        state, status = ctl.gate.state, ctl.status()
        assert state.accepted == 2 * g - 2 and state.rejected == g + 2  # exactly once, each sample
        assert status["controller/samples_left_out"] == 2 and status["controller/groups_done"] == 2
        assert status["controller/groups_dropped"] == 1 and status["controller/groups_dropped/verifier_error"] == 1
        assert ctl.drops.top_cause() == NAN
    finally:
        worker.close()
        ctl.close()


def _supervisor(tmp_path: Path, ctl: Controller, rows: list[Metrics]) -> Supervisor:
    sup = Supervisor(ctl.cfg, tmp_path, {"rollout-0": "rollout"}, ctl, handle=None, sink=rows.append, display=None)
    sup.rl_start, sup._rl_start_mono = time.time(), time.monotonic()  # as when the first worker connected
    return sup


def test_a_run_that_trains_no_group_for_no_trainable_group_s_fails_with_its_top_cause(tmp_path):
    ctl = _controller(tmp_path, [], "eval.every=0", "launch.no_trainable_group_s=60")
    try:
        sup = _supervisor(tmp_path, ctl, [])
        for detail in (NAN, NAN, NAN, "outcome() returned None (NoneType), not a real number"):
            ctl.drops.settled(False, "verifier_error", detail)
        sup._watch_drops(time.monotonic() + 59)  # not yet: the limit counts from the first worker
        with pytest.raises(Stop) as stop:
            sup._watch_drops(time.monotonic() + 61)
        assert str(stop.value).startswith(f"no group could be scored in 60 s: 100 % verifier errors, {NAN}")
        ctl.drops.settled(True, "", "")  # one group trained: the run can train
        sup._watch_drops(time.monotonic() + 120)
    finally:
        ctl.close()


def test_a_drop_rate_above_max_drop_rate_is_a_warning_and_an_event(tmp_path, caplog):
    rows: list[Metrics] = []
    ctl = _controller(tmp_path, [], "eval.every=0", "launch.max_drop_rate=0.5")
    try:
        sup = _supervisor(tmp_path, ctl, rows)
        ctl.drops.settled(True, "", "")
        for _ in range(3):
            ctl.drops.settled(False, "env_error", "step() raised ValueError: cannot parse (acme/env.py:12)")
        with caplog.at_level("WARNING", logger="tidal.run"):
            sup._watch_drops(time.monotonic())
            sup._watch_drops(time.monotonic())  # once per window
        warnings = [r.getMessage() for r in caplog.records if "launch.max_drop_rate" in r.getMessage()]
        assert len(warnings) == 1 and "75 % of the last 4" in warnings[0] and "acme/env.py:12" in warnings[0]
        events = [r.scalars for r in rows if "event/drop_rate" in r.scalars]
        assert len(events) == 1 and events[0]["event/drop_rate/rate"] == 0.75
    finally:
        ctl.close()


def test_an_evaluation_that_scored_nothing_has_no_accuracy_and_is_never_best(tmp_path):
    rows: list[Metrics] = []
    ctl = _controller(tmp_path, rows, "eval.every=5", "eval.size=3")
    worker = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        worker.send(Heartbeat(role="rollout", name="rollout-0", seq=0, time=time.time(), version=5))
        _step_until(ctl, lambda: "rollout-0" in ctl.workers)
        ctl.start_eval(5)
        evals = [worker.recv(timeout=5) for _ in range(3)]
        assert all(EVAL_KEY in a.metadata for a in evals)
        for a in evals:
            worker.send(Ack(kind="assignment", ids=[a.group_id], ok=False, reason="verifier_error", detail=NAN))
        _step_until(ctl, lambda: bool(ctl.eval_unscored))
        assert ctl.eval_unscored == [5] and ctl.eval_results == []
        scalars = [r.scalars for r in rows if r.source == "controller"]
        assert not any("eval/accuracy" in s for s in scalars)
        assert any(s.get("eval/unscored") == 1.0 and s["eval/failed"] == 3 for s in scalars)
        assert not (ctl.checkpoint_dir / "best").exists()
    finally:
        worker.close()
        ctl.close()


# An author's environment whose every outcome is a verifier error: registered by module name
# (rollout.episodes.plugins) in the driver, the worker and its environment process.
FAILING_ENV = '''
import itertools

from tidal.core.episodes import AGENT, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.plugins import hookimpl
from tidal.core.protocol import ChatMessage


class Episode:
    roles, tools, stop = (AGENT,), (), ()

    def __init__(self, task):
        self.task = task

    def reset(self):
        return Observation(messages=[ChatMessage(role="user", content=self.task.prompt)])

    def step(self, action, role=AGENT):
        return StepResult(done=True)

    def outcome(self):
        raise ValueError("the judge cannot read this answer (judge_tidal/env.py:21)")


class Judge:
    max_turns = 1

    def tasks(self, split, seed):
        return (Task(prompt=f"add {i} and {i}", answer=str(2 * i), domain="judge") for i in itertools.count(seed))

    def episode(self, task):
        return Episode(task)


@hookimpl
def tidal_envs():
    return {"judge": Judge}
'''


@pytest.fixture(scope="module")
def judge_world(tmp_path_factory) -> tuple[Path, dict]:
    import os

    from tidal.rollout.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("judge")
    model = build_tiny_model(root / "model", seed=0)
    site = root / "site"
    site.mkdir()
    (site / "judge_env.py").write_text(FAILING_ENV)
    return model, {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.timeout(120)
def test_a_run_whose_every_outcome_is_a_verifier_error_ends_failed_with_the_authors_text(judge_world, tmp_path,
                                                                                         tidal_cli):
    import json

    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    rc, out = tidal_cli.run(judge_world, run_dir, 'domains=[{env={name="judge"}}]', 'rollout.episodes.plugins=["judge_env"]',
                            "rollout.episodes.processes=1", "rollout.episodes.max_tokens=32", "workers=1",
                            "group_size=4", "batch_groups=2", "sampling.max_tokens=4", "eval.every=1000",
                            "eval.size=4", "launch.no_trainable_group_s=5", timeout=110)
    seconds = time.monotonic() - t0
    final = json.loads((run_dir / "final.json").read_text())
    status = final["status"]
    assert rc != 0 and status.startswith("failed: no group could be scored in 5 s: 100 % verifier errors"), \
        (status, out[-3000:] + tidal_cli.logs(run_dir))
    assert "outcome() failed: ValueError: the judge cannot read this answer (judge_tidal/env.py:21)" in status, status
    assert final["versions"] == 0 and final["eval_unscored"] == [0] and final["eval"] == [], final
    ctl = final["controller"]
    assert ctl["controller/groups_dropped/verifier_error"] >= 1 and ctl["controller/groups_done"] == 0, ctl
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/accuracy" in m["scalars"] for m in metrics), "an unscored eval got an accuracy"
    assert seconds < 60, f"a run that could not train took {seconds:.0f} s to say so"


def test_the_report_lists_an_unscored_evaluation_apart_with_no_accuracy():
    from tidal.integration.report import summarize

    rows = [{"source": "controller", "elapsed": 1.0, "scalars": {"eval/version": 0.0, "eval/unscored": 1.0,
                                                                 "eval/failed": 4.0}},
            {"source": "controller", "elapsed": 9.0, "scalars": {"eval/version": 5.0, "eval/accuracy": 0.5}}]
    s = summarize(rows)
    assert s["eval_unscored"] == [0] and [e["version"] for e in s["eval"]] == [5] and s["eval_start"] == 0.5


def test_a_run_that_trained_nothing_names_its_top_reason_and_that_reasons_text(tmp_path):
    ctl = _controller(tmp_path, [], "eval.every=0")
    try:
        sup = _supervisor(tmp_path, ctl, [])
        stuck = "environment process rollout-0-env-1 was killed: stuck on episode g:3 for more than 3 s"
        for _ in range(3):  # trained on survivors: the most frequent text, but of no drop
            ctl.drops.settled(True, "", "outcome() returned None (NoneType), not a real number", left_out=1)
        for _ in range(2):
            ctl.drops.settled(False, "timeout", stuck)
        ctl.drops.settled(False, "verifier_error", NAN)
        # the status quotes the top reason's own text, not a more frequent text of another reason
        assert sup.untrained() == f"0 versions trained: 3 groups trained on, 3 dropped: 67 % timeout, {stuck}"
    finally:
        ctl.close()
