"""The run's controller against real sockets: a worker that leaves between its last message and the
next send (killed, crashed) is lost, not fatal: its work goes to the others and a stop does not raise."""

from __future__ import annotations

import time
from pathlib import Path

from tidal.core.channels import dealer
from tidal.core.protocol import Assignment, Heartbeat, WorkRequest
from tidal.integration.controller import Controller
from tidal.integration.recipe import load_recipe
from tidal.rollout.tiny import build_char_tokenizer

RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"


def _step_until(ctl: Controller, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the controller did not get there in time"
        ctl.step(0.02)


def test_a_worker_gone_since_its_last_message_is_lost_not_fatal(tmp_path):
    cfg = load_recipe(RECIPE, ["eval.every=0", f"model=\"{tmp_path}\""])  # the controller reads no model
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                     buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                     emit=lambda m: None)
    stays = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        with dealer(ctl.ch.endpoint, identity=b"rollout-1", linger=0) as leaves:
            leaves.send(Heartbeat(role="rollout", name="rollout-1", seq=0, time=time.time(), version=0))
            _step_until(ctl, lambda: "rollout-1" in ctl.workers)
        # its request for work arrived just before it died: the controller learns of the death only when
        # a send to it fails (the router notices the disconnect asynchronously; retry until it has)
        gone = ctl.workers["rollout-1"]
        deadline = time.monotonic() + 10
        while gone.alive:
            assert time.monotonic() < deadline, "a send to the departed worker never failed"
            gone.credits = 2
            ctl.step(0.02)
        assert not gone.outstanding and gone.credits == 0
        assert ctl.counts["groups_requeued"] >= 1 and len(ctl.requeued) == ctl.counts["groups_requeued"]
        requeued = [a.group_id for a in ctl.requeued]
        # rollout-0 asks for work: it is served what rollout-1 was sent first
        stays.send(WorkRequest(want=len(requeued), version=0))
        _step_until(ctl, lambda: not ctl.requeued)
        got = [stays.recv(timeout=5) for _ in requeued]
        assert all(isinstance(a, Assignment) for a in got)
        assert [a.group_id for a in got] == requeued
        ctl.stop_workers("test over")  # skips rollout-1, which is gone, without raising
        assert stays.recv(timeout=5).command == "stop"
    finally:
        stays.close()
        ctl.close()


def test_stop_strings_reach_the_workers_whole_and_single_token_ones_as_ids(tmp_path):
    # "Answer:" is seven tokens of the char tokenizer: sent one by one as stop ids, any of its letters
    # would end a completion
    cfg = load_recipe(RECIPE, ["eval.every=0", f"model=\"{tmp_path}\"", 'sampling.stop=["\\n", "Answer:"]'])
    tok = build_char_tokenizer()
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                     buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=tok, emit=lambda m: None)
    worker = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        worker.send(Heartbeat(role="rollout", name="rollout-0", seq=0, time=time.time(), version=0))
        worker.send(WorkRequest(want=1, version=0))
        _step_until(ctl, lambda: ctl.counts["groups_granted"] >= 1)
        got = worker.recv(timeout=5)
        assert isinstance(got, Assignment)
        assert got.sampling.stop_token_ids == tok.encode("\n") and got.sampling.stop == ["Answer:"]
        assert ctl.eval_sampling.stop_token_ids == tok.encode("\n") and ctl.eval_sampling.stop == ["Answer:"]
    finally:
        worker.close()
        ctl.close()
