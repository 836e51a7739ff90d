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


def _controller(tmp_path, *overrides: str) -> Controller:
    cfg = load_recipe(RECIPE, [f"model=\"{tmp_path}\"", *overrides])
    return Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                      buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                      emit=lambda m: None)


def _recv_all(ch, n: int) -> list:
    return [ch.recv(timeout=5) for _ in range(n)]


def test_evaluation_work_of_a_lost_worker_waits_apart_from_training_credits(tmp_path):
    """The scenario that once stalled a run: the only worker dies during an evaluation round. Its
    evaluation groups wait for a live worker instead of being handed out as training work (which used
    up training credits the worker never gave back); an unscorable problem finishes the round as
    failed, an aborted one is tried again."""
    from tidal.core.protocol import Ack, Trajectory
    from tidal.core.testing import make_trajectory
    from tidal.rollout.worker.process import EVAL_KEY

    ctl = _controller(tmp_path, "eval.every=5", "eval.size=4")
    first = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    second = dealer(ctl.ch.endpoint, identity=b"rollout-1", linger=0)  # the one live worker after it
    try:
        first.send(Heartbeat(role="rollout", name="rollout-0", seq=0, time=time.time(), version=0))
        _step_until(ctl, lambda: "rollout-0" in ctl.workers)
        ctl.start_eval(0)
        evals = _recv_all(first, 4)
        assert all(EVAL_KEY in a.metadata and a.prompt and a.domain == "arithmetic" for a in evals)
        ctl.worker_lost("rollout-0")
        assert len(ctl.eval_waiting) == 4 and not ctl.requeued  # never queued as training work
        second.send(WorkRequest(want=2, version=0))
        _step_until(ctl, lambda: not ctl.eval_waiting and "rollout-1" in ctl.workers
                    and ctl.workers["rollout-1"].credits == 0)
        got = _recv_all(second, 6)
        train = [a for a in got if EVAL_KEY not in a.metadata]
        again = [a for a in got if EVAL_KEY in a.metadata]
        assert len(train) == 2 and sorted(a.group_id for a in again) == sorted(a.group_id for a in evals)
        # one problem cannot be scored, one is aborted (tried again), the others come back scored
        a0, a1, *rest = again
        second.send(Ack(kind="assignment", ids=[a0.group_id], ok=False, detail="verifier crashed",
                        reason="score_error"))
        second.send(Ack(kind="assignment", ids=[a1.group_id], ok=False, detail="weights changed", reason="abort"))
        _step_until(ctl, lambda: ctl.eval_attempts.get(a1.group_id) == 1 and a0.group_id in ctl.evals[0].failed)
        retried = second.recv(timeout=5)
        assert retried.group_id == a1.group_id
        for a in [retried, *rest]:
            t = make_trajectory(0, completion_len=3)
            second.send(Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__},
                                      "group_id": a.group_id, "reward": 1.0}))
        _step_until(ctl, lambda: bool(ctl.eval_results))
        version, accuracy, by_domain = ctl.eval_results[0]
        assert (version, accuracy) == (0, 1.0) and by_domain == {"arithmetic": 1.0}
        rnd = ctl.evals[0]
        assert set(rnd.failed) == {a0.group_id} and len(rnd.rewards) == 3
        assert "controller/groups_dropped/score_error" not in ctl.status()  # an eval problem is no training group
        assert ctl.last_error["rollout-1"].endswith("verifier crashed")
    finally:
        first.close()
        second.close()
        ctl.close()


def test_a_task_the_tokenizer_cannot_encode_is_skipped_and_named(tmp_path, caplog):
    from tidal.core.interfaces import Task
    from tidal.integration.domains import check_task

    ctl = _controller(tmp_path, "eval.every=0")
    d = ctl.domains[0]
    tasks = iter([Task(prompt="3+4=\u00e9", answer="7"), Task(prompt="3+4=", answer="7")])
    d.train = tasks
    caplog.set_level("ERROR")
    a = ctl._new_assignment()
    assert a.prompt == "3+4=" and ctl.tasks_skipped == {"arithmetic": 1}
    assert "'é' (U+00E9) at position 4" in caplog.text and "domains[0]" in caplog.text
    ctl.close()
    from tidal.core.errors import PluginError

    try:
        check_task(Task(prompt="1+1=", metadata={"level": 3}), "acme", "domains[1]")
    except PluginError as e:
        assert "env 'acme' (domains[1])" in str(e) and "metadata['level'] = 3 (int)" in str(e)
    else:
        raise AssertionError("metadata that is not text passed the check")
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


def test_the_learners_first_step_marks_when_it_was_up_and_its_rows_give_the_trained_rate(tmp_path):
    """The RL phase starts once every role is up: for the learner, when its first step began (its first
    metrics row's time minus that step's duration); later rows move only the newest step's time. The live
    view's samples/s is what the learner trained per second over its last 10 s of rows."""
    from tidal.core.protocol import Metrics

    ctl = _controller(tmp_path)
    try:
        assert ctl.trained_per_s() == 0.0
        for version, at in ((1, 100.0), (2, 100.5), (3, 101.0)):
            ctl._on_published("metrics", Metrics(source="learner-0", step=version, time=at, scalars={
                "train/version": version, "train/step_s": 0.25, "train/sequences": 64,
                "train/samples_total": 64 * version}))
        assert ctl.learner_up_at == 99.75
        assert ctl.learner_step_at == 101.0 and ctl.learner_version == 3
        assert ctl.trained_per_s() == 192 / 1.25  # from the first step's start
        ctl._on_published("metrics", Metrics(source="learner-0", step=4, time=120.0, scalars={
            "train/version": 4, "train/step_s": 0.25, "train/sequences": 64, "train/samples_total": 256}))
        assert ctl.trained_per_s() == 64 / 19.0  # one step in the window: from the row before it
    finally:
        ctl.close()


def test_a_malformed_or_nested_message_is_counted_by_reason_and_the_controller_serves_on(tmp_path):
    from tidal.core.codec import MAGIC
    from tidal.core.protocol import PROTOCOL_VERSION

    ctl = _controller(tmp_path, "eval.every=0")
    try:
        with dealer(ctl.ch.endpoint, identity=b"rollout-9", linger=0) as rogue:
            rogue.socket.send(MAGIC + bytes(PROTOCOL_VERSION) + b"\x92\xa9Heartbeat" + b"\x91" * 200_000 + b"\xc0")
            rogue.socket.send(b"GET / HTTP/1.1\r\n\r\n")
            _step_until(ctl, lambda: sum(ctl.protocol_errors.values()) >= 2)
            status = ctl.status()
            assert status["controller/protocol_errors/not_tidal"] == 1.0
            assert sum(v for k, v in status.items() if k.startswith("controller/protocol_errors/")) == 2.0
            # control: the same peer's valid message on the same socket is heard
            rogue.send(Heartbeat(role="rollout", name="rollout-9", seq=0, time=time.time(), version=0))
            _step_until(ctl, lambda: "rollout-9" in ctl.workers)
    finally:
        ctl.close()


def test_the_controller_measures_its_load_its_backlog_and_how_long_a_version_takes_to_reach_every_worker(tmp_path):
    """What tools/bench/control_plane.py reads: the messages the workers sent, how old a heartbeat was when
    the loop took it, and the time from the learner's announcement of a version to the last live worker
    reporting it holds it (the first announcement counts, not the re-announcements)."""
    from tidal.core.channels import pub
    from tidal.core.protocol import TOPIC_WEIGHTS, WeightsAvailable

    learner = pub("tcp://127.0.0.1:*", watch_subscriptions=True, linger=0)
    cfg = load_recipe(RECIPE, ["eval.every=0", f"model=\"{tmp_path}\""])
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub=learner.endpoint, buffer_pub="tcp://127.0.0.1:9",
                     run_dir=tmp_path, tokenizer=build_char_tokenizer(), emit=lambda m: None)
    workers = [dealer(ctl.ch.endpoint, identity=f"rollout-{i}".encode(), linger=0) for i in range(2)]
    try:
        assert learner.wait_for_subscriber(TOPIC_WEIGHTS, 10)

        def beat(w: int, version: int, age_s: float = 0.0) -> None:
            workers[w].send(Heartbeat(role="rollout", name=f"rollout-{w}", seq=0, time=time.time() - age_s,
                                      version=version))

        beat(0, 0, age_s=0.5)  # sent half a second before the loop takes it
        beat(1, 0)
        _step_until(ctl, lambda: len(ctl.workers) == 2)
        assert ctl.messages_in == 2
        assert max(ctl.heartbeat_age_s) >= 0.5
        ann = WeightsAvailable(version=1, transport="zmq", manifest=[])
        learner.publish(TOPIC_WEIGHTS, ann)
        _step_until(ctl, lambda: 1 in ctl._announced_at)
        beat(0, 1)
        _step_until(ctl, lambda: ctl.workers["rollout-0"].version == 1)
        time.sleep(0.3)
        learner.publish(TOPIC_WEIGHTS, ann)  # a re-announcement: the clock still runs from the first
        beat(1, 1)  # the last worker: the version has reached them all
        _step_until(ctl, lambda: ctl.generation_version() == 1)
        assert len(ctl.version_to_all_s) == 1 and 0.3 <= ctl.version_to_all_s[0] < 5.0
        status = ctl.status()
        assert status["controller/messages_in"] == 4.0
        assert status["controller/version_to_all_ms_median"] >= 300
        assert status["controller/heartbeat_age_ms_max"] >= 500
    finally:
        for w in workers:
            w.close()
        ctl.close()
        learner.close()


def test_selfplay_groups_carry_their_opponent_and_the_gate_counts_every_seat(tmp_path):
    """A self-play run's controller: each training group of the game names its opponent (the pool's pick),
    a mirror game's group holds group_size / 2 games (two samples each), held-out games are played
    against the scripted player with the live seat alternating, and the live seat's results rate the
    opponent the group was played against."""
    from tidal.core.episodes import OPPONENT_KEY, SEAT_KEY
    from tidal.core.protocol import Ack
    from tidal.integration.recipe import recipes_dir
    from tidal.rollout.worker.process import EVAL_KEY

    recipe = recipes_dir() / "selfplay.toml"
    cfg = load_recipe(recipe, [f"model=\"{tmp_path}\"", "eval.size=4", "selfplay.opponent.options.live_prob=0.5"])
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                     buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                     emit=lambda m: None)
    worker = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        (tmp_path / "snapshots").mkdir()
        (tmp_path / "snapshots" / "v000000.safetensors").write_bytes(b"w")  # the learner's first snapshot
        ctl.selfplay.poll(now=0.0)
        worker.send(WorkRequest(want=12, version=0))
        _step_until(ctl, lambda: ctl.workers.get("rollout-0") is not None and ctl.workers["rollout-0"].credits == 0)
        got = _recv_all(worker, 12)
        opponents = [a.metadata[OPPONENT_KEY] for a in got]
        assert set(opponents) == {"live", "v0"}, opponents
        assert all(a.num_samples == (4 if a.metadata[OPPONENT_KEY] == "live" else 8) for a in got)
        granted = ctl.gate.state.in_flight
        assert granted == 12 * cfg.group_size  # every group is group_size samples, mirror games' too
        mirror = next(a for a in got if a.metadata[OPPONENT_KEY] == "live")
        played = next(a for a in got if a.metadata[OPPONENT_KEY] == "v0")
        worker.send(Ack(kind="assignment", ids=[mirror.group_id], left_out=2))  # one game failed: its 2 seats' samples
        worker.send(Ack(kind="assignment", ids=[played.group_id], scores=[1.0] * 8))
        _step_until(ctl, lambda: ctl.gate.state.in_flight == granted - 16)
        assert ctl.gate.state.accepted == 6 + 8 and ctl.gate.state.rejected == 2
        assert ctl.selfplay.sampler.state()["pool"][0]["mu"] < ctl.selfplay.sampler.state()["live"]["mu"]
        ctl.start_eval(0)
        evals = [a for a in _recv_all(worker, 4) if EVAL_KEY in a.metadata]
        assert [a.metadata[SEAT_KEY] for a in evals] == ["first", "second", "first", "second"]
        assert {a.metadata[OPPONENT_KEY] for a in evals} == {"scripted"}
    finally:
        worker.close()
        ctl.close()
