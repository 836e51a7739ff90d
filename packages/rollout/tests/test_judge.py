"""The `judge` reward plugin against a scripted OpenAI-compatible judge over real HTTP: scores mapped to
[0, 1]; a timeout, an HTTP error, a refusal and a reply without a score each raise JudgeError of their
kind (never a silent 0) and are counted; bad options are refused by name; concurrent calls are served at
once. The worker scoring judged groups off its loop: tests/test_rollout_worker.py."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.rollout.judge import Judge, JudgeError

sys.path.insert(0, str(Path(__file__).parent))
from judge_server import JudgeServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = JudgeServer(score=8, hang_s=5)
    yield s
    s.close()


def test_scores_are_mapped_and_each_failure_is_an_error_of_its_kind(server):
    judge = registry.build("reward", "judge", {"endpoint": server.endpoint, "model": "grader", "timeout_s": 1.0})
    task = Task(prompt="2+2=", answer="4")
    assert judge(task, "4") == pytest.approx(0.8)
    assert judge(task, "SCORE=10") == pytest.approx(1.0)
    body = server.bodies[0]
    assert body["model"] == "grader" and body["temperature"] == 0.0
    assert "2+2=" in body["messages"][0]["content"] and "4" in body["messages"][0]["content"]
    for text, kind in [("HANG", "timeout"), ("ERROR", "http"), ("REFUSE", "refused"), ("GARBLE", "unparsable"),
                       ("SCORE=11", "unparsable")]:
        with pytest.raises(JudgeError, match=f"judge {kind}") as e:
            judge(task, text)
        assert e.value.kind == kind
    m = judge.metrics()
    assert m["reward/judge/calls"] == 7.0
    assert {k: v for k, v in m.items() if "/errors/" in k} == {
        "reward/judge/errors/timeout": 1.0, "reward/judge/errors/http": 1.0, "reward/judge/errors/refused": 1.0,
        "reward/judge/errors/unparsable": 2.0}
    assert m["reward/judge/latency_ms_median"] > 0 and m["reward/judge/calls_per_s"] > 0


def test_a_judge_nobody_listens_on_is_a_connection_error():
    from tidal.core.testing import free_port

    judge = Judge(endpoint=f"http://127.0.0.1:{free_port()}/v1", timeout_s=2)
    with pytest.raises(JudgeError, match="judge connection"):
        judge(Task(prompt="p"), "c")


@pytest.mark.parametrize(("options", "needle"), [
    ({"endpoint": "127.0.0.1:8000"}, "an http(s) URL of an OpenAI-compatible API"),
    ({"endpoint": "http://x/v1", "min_score": 5, "max_score": 5}, "max_score (5) must be above min_score (5)"),
    ({"endpoint": "http://x/v1", "rubric": "grade {answer}"}, "only {prompt}, {completion} and {reference}"),
])
def test_bad_options_are_refused_by_name(options, needle):
    with pytest.raises(Exception, match=needle.replace("(", r"\(").replace(")", r"\)")):
        registry.build("reward", "judge", options)


def test_calls_are_served_concurrently(server):
    server.delay_s = 0.5
    judge = Judge(endpoint=server.endpoint, timeout_s=10)
    scores: list[float] = []
    threads = [threading.Thread(target=lambda: scores.append(judge(Task(prompt="p"), "c"))) for _ in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scores == [pytest.approx(0.8)] * 8
    assert server.most_in_flight >= 4 and time.monotonic() - t0 < 8 * 0.5, server.most_in_flight
