"""The buffer finds tidal-staleness' admission policy and tidal-algos' group filter by name (it imports
neither), and applies them in a real service process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.buffer import BatchClient
from tidal.core.arrays import Array
from tidal.core.protocol import Trajectory, TrajectoryGroup
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint


def traj(tid: str, group: str, version: int, reward: float) -> Trajectory:
    n = 4
    return Trajectory(id=tid, group_id=group, sample_index=0, task="t", prompt_ids=Array.from_list([1, 2], "int32"),
                      completion_ids=Array.from_list([3] * n, "int32"), logprobs=Array.from_list([-0.5] * n, "float32"),
                      versions=Array.from_list([version] * n, "int32"), reward=reward, finish_reason="stop", source="w")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unit", ["trajectory", "group"])
def test_admission_and_filters_by_plugin_name(tmp_path, unit):
    """Sent as groups, the same samples meet the same rules: the stale one is refused alone."""
    ingest, serve, publish = free_endpoint(), free_endpoint(), free_endpoint()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{tmp_path}"', "group_size=2", "batch_samples=2",
         'admission={name="version_rejection", options={max_lag=1}}', 'filters=[{name="zero_variance"}]'],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        with BatchClient(serve, retry_every=0.5) as learner:
            learner.status(timeout=60)  # the service is up
            with pytest.raises(TimeoutError):
                learner.next_batch(version=5, timeout=2)  # tells the buffer the learner is at version 5
            with AckedPusher(ingest, publish, "w", resend_after=0.5) as out:
                samples = [traj("a0", "A", 5, 0.0), traj("a1", "A", 5, 1.0),   # fresh, rewards differ: kept
                           traj("b0", "B", 4, 1.0), traj("b1", "B", 4, 1.0),   # lag 1, equal rewards: filtered
                           traj("c0", "C", 2, 1.0), traj("c1", "C", 5, 1.0)]   # c0 lag 3 > max_lag: refused
                if unit == "group":
                    samples = [TrajectoryGroup(id=g, trajectories=[t for t in samples if t.group_id == g], source="w")
                               for g in "ABC"]
                for t in samples:
                    out.send(t)
                out.flush(timeout=30)
                assert set(out.rejected) == {"c0"} and "stale" in out.rejected["c0"], out.rejected
            batch = learner.next_batch(version=5, timeout=30)
            assert sorted(t.id for t in batch.trajectories) == ["a0", "a1"]
            learner.ack(batch.batch_id)
            s = learner.status().scalars
            assert s["drops/filter:zero_variance"] == 2 and s["drops/admission:stale"] == 1
            assert s["total/accepted"] == 5 and s["depth/assembling_groups"] == 1  # c1 waits for its group
    finally:
        proc.terminate()
        out_text = proc.communicate(timeout=10)[0]
    assert "replayed 0 WAL records" in out_text
