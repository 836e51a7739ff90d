"""Which tokens of a sequence each rank holds: padding to a multiple of the mesh, zigzag chunks over the
ring, contiguous slices over Ulysses, and the segment ids that keep packed sequences apart.

Zigzag (load-balanced) sharding: the padded sequence is cut into 2·ring chunks and ring rank r holds
chunks r and 2·ring−1−r, so under a causal mask every ring rank has the same amount of unmasked work.
Padding tokens get segment id −1: real tokens never attend to them and their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.seqpar.mesh import SPMesh

PAD_SEGMENT = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardLayout:
    """The token layout of one sharded batch, identical on every rank of a mesh."""

    seq_len: int  # tokens per row before padding
    padded_len: int  # tokens per row after padding to a multiple of the mesh's chunking
    ring: int  # ring degree of the mesh the layout was planned for
    ulysses: int  # Ulysses degree of the mesh
    causal: bool  # whether a token attends only to earlier tokens of its segment
    segments: torch.Tensor  # [B, padded_len] int64 segment id per token (−1 for padding)

    def ring_indices(self, ring_rank: int) -> torch.Tensor:
        """[padded_len / ring] global token indices ring rank `ring_rank` holds, in its local order
        (the order of the sequence after the Ulysses all-to-all)."""
        if self.ring == 1:
            return torch.arange(self.padded_len)
        c = self.padded_len // (2 * self.ring)
        r = ring_rank
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * self.ring - 1 - r) * c, (2 * self.ring - r) * c)])

    def rank_indices(self, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
        """[padded_len / (ring·ulysses)] global token indices held by the rank at (ring_rank, ulysses_rank)."""
        piece = self.ring_indices(ring_rank)
        n = piece.numel() // self.ulysses
        return piece[ulysses_rank * n:(ulysses_rank + 1) * n]

    def chunk_len(self) -> int:
        """Length of one zigzag chunk: the granularity at which masked work is skipped."""
        return self.padded_len // (2 * self.ring) if self.ring > 1 else self.padded_len


def segments_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] segment ids of packed sequences: a new segment starts wherever the position id is 0
    (or does not follow the previous one by +1). Tokens before the first 0 belong to segment 0."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1)


def plan_layout(seq_len: int, mesh: SPMesh, *, batch: int = 1, position_ids: torch.Tensor | None = None,
                causal: bool = True) -> ShardLayout:
    """Plan how a [batch, seq_len] sequence is padded and split over `mesh`.

    `position_ids` ([batch, seq_len], optional) marks packed sequences: each run of consecutive
    positions is one sequence and no token attends across a boundary. Without it each row is one sequence.
    """
    if position_ids is not None:
        if position_ids.shape != (batch, seq_len):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected ({batch}, {seq_len})")
        segments = segments_from_position_ids(position_ids.cpu().long())
    else:
        segments = torch.zeros(batch, seq_len, dtype=torch.long)
    multiple = mesh.ulysses * (2 * mesh.ring if mesh.ring > 1 else 1)
    padded = -(-seq_len // multiple) * multiple
    if padded > seq_len:
        segments = torch.cat([segments, torch.full((batch, padded - seq_len), PAD_SEGMENT, dtype=torch.long)], 1)
    return ShardLayout(seq_len=seq_len, padded_len=padded, ring=mesh.ring, ulysses=mesh.ulysses, causal=causal,
                       segments=segments)


def shard(x: torch.Tensor, layout: ShardLayout, mesh: SPMesh, *, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
    """This rank's shard of a full tensor whose `dim` is the sequence: pad to `layout.padded_len` with
    `pad_value`, then take the rank's tokens. Shape: same as `x` with `dim` of size padded_len / mesh.size."""
    dim = dim % x.dim()
    extra = layout.padded_len - x.shape[dim]
    if extra:
        shape = list(x.shape)
        shape[dim] = extra
        x = torch.cat([x, x.new_full(shape, pad_value)], dim)
    idx = layout.rank_indices(mesh.ring_rank, mesh.ulysses_rank).to(x.device)
    return x.index_select(dim, idx)


def unshard(x: torch.Tensor, layout: ShardLayout, mesh: SPMesh, *, dim: int = 1) -> torch.Tensor:
    """Gather every rank's shard back into the full, unpadded tensor (not differentiable; for outputs
    and checks). Shape: `x` with `dim` of size layout.seq_len."""
    dim, x = dim % x.dim(), x.contiguous()
    if mesh.size == 1:
        parts = [x]
    else:
        parts = [torch.empty_like(x) for _ in range(mesh.size)]
        dist.all_gather(parts, x, group=mesh.group)
    order = torch.cat([layout.rank_indices(i // mesh.ulysses, i % mesh.ulysses) for i in range(mesh.size)])
    full = torch.cat(parts, dim)
    out = torch.empty_like(full)
    out.index_copy_(dim, order.to(x.device), full)
    return out.narrow(dim, 0, layout.seq_len)
