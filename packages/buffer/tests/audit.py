"""What the buffer's tests check at the end: what producers were promised against what learners trained."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path


def read_ids(*files: Path) -> list[str]:
    out: list[str] = []
    for f in files:
        if f.exists():
            out += [line for line in f.read_text().splitlines() if line]
    return out


def assert_exactly_once(acked: list[str], trained: list[str]) -> None:
    dupes = [i for i, c in Counter(trained).items() if c > 1]
    assert not dupes, f"{len(dupes)} trajectories trained more than once, e.g. {dupes[:5]}"
    missing = set(acked) - set(trained)
    assert not missing, f"{len(missing)} acknowledged trajectories never trained, e.g. {sorted(missing)[:5]}"
    assert set(trained) <= set(acked)


def kill_9_drill(buf, producers, make_learners, units: list[str], *, kills: int, seed: int, per_producer: int = 320,
                 group_size: int = 4) -> None:
    """Producers (one per entry of `units`: "trajectory" or "group") send `per_producer` trajectories each
    while the buffer is killed -9 `kills` times at random moments and restarted on the same log and ports;
    then every acknowledged trajectory was trained exactly once and the restarts replayed the log."""
    files = [producers.start(buf, f"{unit[:3]}{i}", per_producer, group_size, resend_after=0.5, unit=unit)
             for i, unit in enumerate(units)]
    learners = make_learners(buf.serve, world_size=1, group_size=group_size)
    rng = random.Random(seed)
    total = per_producer * len(units)
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.5, 2.5))
            buf.kill9()
            time.sleep(rng.uniform(0.0, 0.5))
            buf.start()
        producers.wait(timeout=300)
        acked = read_ids(*files)
        assert len(acked) == total
        learners.wait_for(total, timeout=120)
    finally:
        learners.stop()
    assert not learners.errors, learners.errors
    assert_exactly_once(acked, learners.trained)
    assert not learners.incomplete_groups
    assert "replayed" in buf.log_text()
