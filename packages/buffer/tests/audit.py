"""What the buffer's tests check at the end: what producers were promised against what learners trained."""

from __future__ import annotations

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
