"""The buffer checks the values of what it stores: a trajectory with a NaN or huge reward, a non-finite
logprob, a token id the model cannot embed or versions from the future is refused before it is acked or
stored, counted by reason, and its producer told why (a negative Ack, not resent); a BatchRequest cannot
move the learner version by an absurd jump."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tidal.buffer.config import BufferConfig
from tidal.buffer.service import BufferService
from tidal.buffer.store import body_of, decode_samples, encode_trajectory
from tidal.buffer.validate import Refusal, check_all_values, check_values
from tidal.core.arrays import Array
from tidal.core.config import PluginRef
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint, make_group, make_trajectory

VOCAB = 32_000


def _forged(reason: str, i: int = 0):
    t = make_trajectory(i, rich=True)
    n = t.completion_ids.shape[0]
    if reason == "nonfinite_reward":
        t.reward = float("nan")
    elif reason == "reward_out_of_range":
        t.reward = 1e6
    elif reason == "nonfinite_logprob":
        lp = t.logprobs.numpy().copy()
        lp[3] = -np.inf
        t.logprobs = Array.from_numpy(lp)
    elif reason == "nonfinite_step_reward":
        t.step_rewards = Array.from_numpy(np.array([0.5, np.nan], np.float32))
    elif reason == "inconsistent_steps":
        t.step_ends = Array.from_numpy(np.array([1, n + 5], np.int32))
    elif reason == "token_out_of_range":
        ids = t.completion_ids.numpy().copy()
        ids[0] = -5
        t.completion_ids = Array.from_numpy(ids)
    elif reason == "version_ahead":
        t.versions = Array.from_numpy(np.full(n, 1_000_000_000, np.int32))
    return t


REASONS = ["nonfinite_reward", "reward_out_of_range", "nonfinite_logprob", "nonfinite_step_reward",
           "inconsistent_steps", "token_out_of_range", "version_ahead"]


@pytest.mark.parametrize("as_sample", [False, True], ids=["trajectory", "sample"])
@pytest.mark.parametrize("reason", REASONS)
def test_each_kind_of_bad_value_is_refused_with_its_reason(reason, as_sample):
    def check(t):
        if as_sample:  # as the buffer reads a one-frame message: arrays are views into it
            t = decode_samples(body_of(encode_trajectory(t)))
        return check_values(t, VOCAB, 3 + 64, 1e4)

    assert check(make_trajectory(0, rich=True)) is None  # the same trajectory, unforged, passes
    got = check(_forged(reason))
    assert got is not None and got[0] == reason, got


def test_a_token_id_past_the_vocabulary_is_refused_and_unchecked_without_one():
    t = make_trajectory(0)
    ids = t.prompt_ids.numpy().copy()
    ids[-1] = VOCAB
    t.prompt_ids = Array.from_numpy(ids)
    assert check_values(t, VOCAB, None, 0)[0] == "token_out_of_range"  # type: ignore[index]
    assert check_values(t, VOCAB + 1, None, 0) is None
    assert check_values(t, 0, None, 0) is None  # vocab_size 0: unchecked


@pytest.fixture
def service(tmp_path):
    cfg = BufferConfig(ingest=free_endpoint(), serve=free_endpoint(), publish=free_endpoint(),
                       wal_dir=str(tmp_path / "wal"), fsync="never", vocab_size=VOCAB, group_size=4)
    svc = BufferService(cfg)
    yield svc
    svc.close()


def _pump(svc: BufferService, pusher: AckedPusher, until, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the buffer did not settle the messages in time"
        svc.handle_requests()
        svc.drain_ingest()
        svc.commit(force=True)
        svc.release_durable()
        pusher.poll(timeout=0.02)


def test_the_service_refuses_bad_values_counts_them_by_reason_and_tells_the_producer(service):
    svc = service
    svc.learner_version, svc._learner_known = 3, True  # as after a BatchRequest at version 3
    with AckedPusher(svc.ingest.endpoint, svc.pub.endpoint, "w", resend_after=60) as pusher:
        time.sleep(0.3)  # the ack subscription reaches the PUB
        for i, reason in enumerate(REASONS):
            t = _forged(reason, i)
            t.id, t.source = f"bad-{reason}", "w"
            pusher.send(t)
        good = make_group("g-ok", 4, source="w")
        bad_group = make_group("g-bad", 4, source="w")
        bad_group.trajectories[2].reward = float("inf")
        pusher.send(good)
        pusher.send(bad_group)
        _pump(svc, pusher, lambda: not pusher.pending)
        assert sorted(pusher.rejected) == sorted([f"bad-{r}" for r in REASONS] + [f"g-bad:{i}" for i in range(4)])
        assert "NaN or infinite" in pusher.rejected["bad-nonfinite_logprob"]
        assert pusher.acked == 4  # the good group: stored
        assert pusher.resent == 0
    scalars = svc.metrics().scalars
    for reason in REASONS:
        assert scalars[f"refused/{reason}"] == (2.0 if reason == "nonfinite_reward" else 1.0), reason
    assert scalars["total/accepted"] == 4.0 and svc.store.live_trajectories == 4


def test_a_batch_request_cannot_jump_the_learner_version_far_ahead(service):
    svc = service
    svc._learner_at(5, b"learner")  # the first request after start sets it
    svc._learner_at(6, b"learner")
    svc._learner_at(1_000_000_000, b"attacker")
    assert svc.learner_version == 6 + svc.cfg.max_version_step
    assert svc.metrics().scalars["errors/version_jump"] == 1.0


@pytest.mark.parametrize("reason", REASONS)
def test_a_group_check_finds_the_bad_member_and_its_reason(reason):
    members = [make_trajectory(i, rich=False) for i in range(8)]
    assert check_all_values(members, VOCAB, 3 + 64, 1e4) is None
    as_samples = decode_samples(body_of(encode_trajectory(make_group("g", 8)))).trajectories
    assert check_all_values(as_samples, VOCAB, 3 + 64, 1e4) is None  # views into one frame, joined
    members[5] = _forged(reason, 5)
    got = check_all_values(members, VOCAB, 3 + 64, 1e4)
    assert got is not None and got[:2] == (5, reason), got


@pytest.mark.parametrize("as_sample", [False, True], ids=["trajectory", "sample"])
def test_kv_versions_pass_through_and_a_misshapen_one_is_refused(as_sample):
    from tidal.buffer.store import decode_body
    from tidal.buffer.validate import validate

    def read(t):
        return decode_samples(body_of(encode_trajectory(t))) if as_sample else t

    t = make_trajectory(0, rich=True)  # with kv_versions (protocol 1.5)
    held = read(t)
    assert validate(held) is None and check_values(held, VOCAB, 3 + 64, 1e4) is None
    assert held.kv_versions.numpy().tolist() == t.kv_versions.numpy().tolist()
    assert decode_body(body_of(encode_trajectory(t))).kv_versions == t.kv_versions  # served as it came
    n = t.completion_ids.shape[0]
    for bad in (np.zeros(n - 1, np.int32), np.zeros(n, np.int64)):
        t.kv_versions = Array.from_numpy(bad)
        assert "kv_versions" in (validate(read(t)) or "")


def test_a_resent_trajectory_the_admission_refused_is_refused_again_and_counted_once(tmp_path):
    cfg = BufferConfig(ingest=free_endpoint(), serve=free_endpoint(), publish=free_endpoint(),
                       wal_dir=str(tmp_path / "wal"), fsync="never", vocab_size=VOCAB,
                       admission=PluginRef(name="version_rejection", options={"max_lag": 1}))
    svc = BufferService(cfg)
    try:
        svc.learner_version, svc._learner_known = 10, True
        t = make_trajectory(0)
        t.versions = Array.from_numpy(np.zeros(len(t.completion_ids.numpy()), np.int32))  # 10 versions behind
        first, again = svc.accept(t), svc.accept(t)  # the second: a resend whose negative ack was late
        assert isinstance(first, Refusal) and isinstance(again, Refusal) and str(again) == str(first)
        assert svc.store.drops == {"admission:stale": 1}
    finally:
        svc.close()
