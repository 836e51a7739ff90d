"""The sequence-parallel mesh: which process groups split a sequence, and this rank's place in them.

A mesh of `ulysses × ring` ranks splits one sequence: the ring dimension is outer (each ring rank holds a
zigzag pair of chunks), the Ulysses dimension inner (each Ulysses rank a contiguous slice of that pair).
SP rank = ring_rank * ulysses + ulysses_rank. With world size W, there are W / (ulysses * ring) such
meshes side by side (data parallel over them), built from consecutive global ranks.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True, kw_only=True)
class SPMesh:
    """This rank's sequence-parallel groups. Build it with `make_mesh`; `SPMesh.single()` is the
    one-rank mesh (no communication), the reference every sharded run must equal."""

    ulysses: int  # degree of the Ulysses (all-to-all, head-split) dimension
    ring: int  # degree of the ring (K/V rotation) dimension
    ulysses_rank: int  # this rank's index along the Ulysses dimension
    ring_rank: int  # this rank's index along the ring dimension
    ulysses_group: dist.ProcessGroup | None  # the `ulysses` ranks sharing this rank's ring index
    ring_group: dist.ProcessGroup | None  # the `ring` ranks sharing this rank's Ulysses index
    group: dist.ProcessGroup | None  # all `ulysses * ring` ranks of this sequence

    @property
    def size(self) -> int:
        """Number of ranks one sequence is split over."""
        return self.ulysses * self.ring

    @property
    def rank(self) -> int:
        """This rank's index within the sequence's ranks (ring-major)."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    @classmethod
    def single(cls) -> SPMesh:
        """A mesh of one rank: attention runs locally and nothing is communicated."""
        return cls(ulysses=1, ring=1, ulysses_rank=0, ring_rank=0, ulysses_group=None, ring_group=None, group=None)


def make_mesh(ulysses: int = 1, ring: int = 1) -> SPMesh:
    """Create the process groups of a `ulysses × ring` sequence-parallel mesh over the default group.

    Every rank of the default group must call this with the same arguments (group creation is
    collective). The world size must be a multiple of `ulysses * ring`.
    """
    if ulysses < 1 or ring < 1:
        raise ValueError(f"mesh degrees must be >= 1, got ulysses={ulysses}, ring={ring}")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs torch.distributed initialised first (dist.init_process_group)")
    world, me = dist.get_world_size(), dist.get_rank()
    sp = ulysses * ring
    if world % sp:
        raise ValueError(f"world size {world} is not a multiple of ulysses*ring = {ulysses}*{ring}; "
                         f"choose degrees whose product divides {world}")
    mine: dict[str, dist.ProcessGroup] = {}
    for base in range(0, world, sp):
        block = list(range(base, base + sp))
        g = dist.new_group(block)
        if me in block:
            mine["group"] = _member_group(g)
        for r in range(ring):
            ranks = block[r * ulysses:(r + 1) * ulysses]
            g = dist.new_group(ranks)
            if me in ranks:
                mine["ulysses"] = _member_group(g)
        for u in range(ulysses):
            ranks = block[u::ulysses]
            g = dist.new_group(ranks)
            if me in ranks:
                mine["ring"] = _member_group(g)
    local = me % sp
    return SPMesh(ulysses=ulysses, ring=ring, ulysses_rank=local % ulysses, ring_rank=local // ulysses,
                  ulysses_group=mine["ulysses"], ring_group=mine["ring"], group=mine["group"])


def _member_group(g: object) -> dist.ProcessGroup:
    """`new_group`'s result on a member of the group: the group (GroupMember.NON_GROUP_MEMBER goes to others)."""
    return typing.cast(dist.ProcessGroup, g)
