"""Splitting a step's groups across data-parallel ranks with balanced token counts; which share a rank gets."""

from __future__ import annotations

import heapq
from collections import deque

from tidal.buffer.store import Group


def split_groups(groups: list[Group], world_size: int) -> list[list[Group]]:
    """Whole groups (advantages are computed per group) to ranks, largest first onto the least-loaded
    rank (LPT): the heaviest rank carries at most 4/3 of the optimum. Ties keep arrival order."""
    shares: list[list[Group]] = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]
    for g in sorted(groups, key=lambda g: -g.tokens):
        load, r = heapq.heappop(heap)
        shares[r].append(g)
        heapq.heappush(heap, (load + g.tokens, r))
    return shares


def position_after(q: deque[str] | None, after: str) -> int:
    """Where in a rank's unconsumed shares (oldest first) the one to serve is: just after `after` when the
    rank holds it, else the oldest (a rank that restarted, or whose `after` is already consumed)."""
    if not q or not after:
        return 0
    try:
        return q.index(after) + 1
    except ValueError:
        return 0
