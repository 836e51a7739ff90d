"""The depth gate under randomized producers, a consumer and restarts (hypothesis).

Model: a controller grants samples through the gate at the generators' version; generators finish them
in grant order (FIFO) or in random order; the buffer serves finished samples in arrival order; the
learner trains batches of B and bumps the version. Restarts rebuild the gate from its state file.

Properties: with in-order completion the gate alone keeps every trained sample within max_staleness;
with out-of-order completion, the gate plus VersionRejection(max_lag=S) at serving time does, and the
gate's accounting never drifts. A gate restarted from zeroed counters (the AReaL#1388 bug) is caught.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.staleness.depth import DepthGate
from tidal.staleness.rejection import VersionRejection

ACTIONS = ["grant", "grant", "finish", "finish", "fail", "train", "restart"]


def simulate(data, tmp_path, *, in_order: bool, persist: bool = True) -> dict[str, int]:
    S = data.draw(st.integers(0, 3), label="max_staleness")
    B = data.draw(st.integers(1, 4), label="batch_size")
    # one draw for the whole interleaving: (action, argument) pairs; hypothesis still shrinks it
    script = data.draw(
        st.lists(st.tuples(st.integers(0, len(ACTIONS) - 1), st.integers(0, 1 << 16)), min_size=50, max_size=300),
        label="interleaving",
    )
    path = tmp_path / "gate.json"
    path.unlink(missing_ok=True)
    gate = DepthGate(S, B, path if persist else None)
    reject = VersionRejection(max_lag=S)
    version = 0
    in_flight: list[int] = []  # grant version of each running sample
    buffer: deque[int] = deque()
    trained = violations = dropped = restarts = 0
    for code, arg in script:
        action = ACTIONS[code]
        if action == "grant":
            n = 1 + arg % B
            if gate.try_acquire(n):
                in_flight.extend([version] * n)
        elif action in ("finish", "fail") and in_flight:
            v = in_flight.pop(0 if in_order else arg % len(in_flight))
            if action == "finish":
                buffer.append(v)
                gate.accept(1)
            else:
                gate.reject(1)
        elif action == "train" and len(buffer) >= B:
            for _ in range(B):
                v = buffer.popleft()
                if in_order:
                    # the gate alone must hold the bound
                    violations += (version - v) > S
                    trained += 1
                elif reject.admit([v], version).admit:
                    assert version - v <= S
                    trained += 1
                else:
                    dropped += 1
            version += 1
            gate.set_version(version)
        elif action == "restart":
            restarts += 1
            if persist:
                gate = DepthGate(S, B, path)
            else:  # the bug: counters lost, version restored from the learner
                gate = DepthGate(S, B)
                gate.set_version(version)
        # accounting never drifts, across restarts too
        state = gate.state
        if persist:
            assert state.in_flight == len(in_flight)
            assert gate.capacity() == (S + version + 1) * B - (state.accepted + state.in_flight)
            assert gate.capacity() >= -B  # never over-granted by more than one group
    return {"trained": trained, "violations": violations, "dropped": dropped, "restarts": restarts}


# 300 random interleavings of 50-300 actions each (1,000 took ~30 s a test on CI's 2 cores)
SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(data=st.data())
def test_in_order_training_never_exceeds_the_bound(data, tmp_path_factory):
    result = simulate(data, _dir(tmp_path_factory), in_order=True)
    assert result["violations"] == 0


@SETTINGS
@given(data=st.data())
def test_out_of_order_with_rejection_never_trains_stale_samples(data, tmp_path_factory):
    simulate(data, _dir(tmp_path_factory), in_order=False)  # asserts inside


_DIRS: dict[int, object] = {}


def _dir(factory):
    # one folder per test process: thousands of examples need not make thousands of folders
    return _DIRS.setdefault(id(factory), factory.mktemp("gate"))


def test_zeroed_counters_after_restart_break_the_bound(tmp_path):
    """The negative control: restarting without the persisted state over-grants (AReaL#1388)."""
    S, B = 0, 1
    good = DepthGate(S, B, tmp_path / "g.json")
    for v in range(5):  # five versions of normal operation
        assert good.try_acquire(1)
        good.accept(1)
        good.set_version(v + 1)
    assert DepthGate(S, B, tmp_path / "g.json").capacity() == 1  # restored: one more sample
    broken = DepthGate(S, B)
    broken.set_version(5)
    assert broken.capacity() == 6  # six samples at version 5: the sixth would train at version 10


def test_state_survives_restart_and_is_refused_when_corrupt(tmp_path):
    path = tmp_path / "gate.json"
    g = DepthGate(2, 4, path)
    assert g.try_acquire(4) and g.try_acquire(4)
    g.accept(3)
    g.reject(1)
    g.set_version(1)
    again = DepthGate(2, 4, path)
    assert again.state == g.state and again.capacity() == (2 + 1 + 1) * 4 - (3 + 4)
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match="refusing to start with zeroed counters"):
        DepthGate(2, 4, path)


def test_journal_compacts_and_a_line_cut_by_a_crash_is_skipped(tmp_path, monkeypatch):
    """Each change appends one line; every COMPACT_EVERY lines the file is rewritten to its last one. A
    crash mid-write leaves a partial last line: the restart takes the complete line before it. A file of
    one state with no newline (as written before the journal) loads."""
    from tidal.staleness import depth

    monkeypatch.setattr(depth, "COMPACT_EVERY", 8)
    path = tmp_path / "gate.json"
    g = DepthGate(2, 4, path)
    for v in range(10):  # 30 changes: compacted three times
        assert g.try_acquire(4)
        g.accept(4)
        g.set_version(v + 1)
    lines = path.read_bytes().splitlines()
    assert 1 <= len(lines) <= 8
    assert DepthGate(2, 4, path).state == g.state
    g.close()
    before = g.state
    with open(path, "ab") as f:  # a crash in the middle of the next write
        f.write(b'{"version":11,"accepted":4')
    assert DepthGate(2, 4, path).state == before
    path.write_bytes(lines[-1])  # the pre-journal format: one state, no newline
    assert DepthGate(2, 4, path).state == before
    path.write_bytes(b'{"version":3,"accepted":1,"in_flight":0,"granted":1,"rejected":0}\n{"version":4,"acc\n')
    with pytest.raises(RuntimeError, match="unreadable"):  # a whole line that does not decode is corruption
        DepthGate(2, 4, path)


def test_checkpoint_round_trip_and_invalid_transitions(tmp_path):
    g = DepthGate(1, 2)
    assert g.try_acquire(2)
    saved = g.state_dict()
    g.accept(2)
    g.set_version(3)
    with pytest.raises(ValueError, match="version went back"):
        g.set_version(2)
    g.load_state_dict(saved)
    assert g.state.in_flight == 2 and g.state.version == 0
    with pytest.raises(ValueError, match="only 2 are in flight"):
        g.accept(3)
    assert not g.try_acquire(3)  # capacity (1+0+1)*2 - 2 = 2
