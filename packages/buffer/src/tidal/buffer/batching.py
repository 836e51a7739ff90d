"""Splitting a step's groups across data-parallel ranks with balanced token counts."""

from __future__ import annotations

import heapq

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
