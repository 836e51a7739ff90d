"""Ring attention with zigzag sharding, online-softmax accumulation, optional attention sinks, and a
hand-written backward that sends dK/dV around the ring with K/V.

Each ring rank holds the queries, keys and values of its zigzag pair of chunks. In step t it attends its
queries to the K/V block that started on ring rank (r − t) mod R while the block moves one rank on. Work
is tiled by chunk (at most `block_size` tokens a side) and a tile whose mask is all False — a chunk that
lies wholly in the causal future — is skipped; that is what the zigzag balances. With R = 1 this is
tiled local attention with a memory-lean backward (only q, k, v, out and lse are kept).

Sinks: a learnable logit per query head joins each row's softmax denominator (GPT-OSS):
out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink}). Its gradient is −Σ_rows e^{sink − lse} · rowsum(dout · out).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from tidal.seqpar.collectives import ring_shift
from tidal.seqpar.kernels import block_backward, block_forward, block_mask, merge
from tidal.seqpar.layout import ShardLayout


def _tiles(idx: torch.Tensor, size: int) -> list[tuple[slice, torch.Tensor]]:
    return [(slice(i, i + size), idx[i:i + size]) for i in range(0, idx.numel(), size)]


def _live_tiles(layout: ShardLayout, segs: torch.Tensor, src: int, q_tiles: list[tuple[slice, torch.Tensor]],
                tile: int) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """(query tile, key tile of ring rank `src`'s block, their mask) for every pair whose mask is not all
    False: the tiles forward and backward both visit."""
    for ks, kidx in _tiles(layout.ring_indices(src).to(segs.device), tile):
        for qs, qidx in q_tiles:
            mask = block_mask(segs, qidx, kidx, layout.causal)
            if bool(mask.any()):
                yield qs, ks, mask


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout: ShardLayout, group, rank: int, size: int, scale: float, block: int):
        b, h, sq, d = q.shape
        tile = min(layout.chunk_len(), block)
        segs = layout.segments.to(q.device)
        q_tiles = _tiles(layout.ring_indices(rank).to(q.device), tile)
        out = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(size):
            pending = ring_shift(kv, group, tag=1) if step < size - 1 else None
            for qs, ks, mask in _live_tiles(layout, segs, (rank - step) % size, q_tiles, tile):
                o_b, l_b = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], mask, scale)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
            if pending is not None:
                kv = pending.wait()
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.float()[None, :, None].expand_as(lse))
            out = out * torch.exp(lse - total)[..., None]
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.cfg = (layout, group, rank, size, scale, tile)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        layout, group, rank, size, scale, tile = ctx.cfg
        segs = layout.segments.to(q.device)
        delta = (dout.float() * out.float()).sum(-1)  # [B, H, Sq]
        q_tiles = _tiles(layout.ring_indices(rank).to(q.device), tile)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=q.device) for _ in range(2)]
        for step in range(size):
            pending = ring_shift(kv, group, tag=1) if step < size - 1 else None
            for qs, ks, mask in _live_tiles(layout, segs, (rank - step) % size, q_tiles, tile):
                dq_b, dk_b, dv_b = block_backward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], mask, scale,
                                                  lse[:, :, qs], dout[:, :, qs], delta[:, :, qs])
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if size > 1:
                # the dK/dV accumulator travels with its K/V block; after the last step one more shift
                # brings every block's accumulator home
                dkv = ring_shift(dkv, group, tag=2).wait()
            if pending is not None:
                kv = pending.wait()
        dsinks = None
        if sinks is not None:
            dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks,
                None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout, *,
                   group: dist.ProcessGroup | None, rank: int, size: int, sinks: torch.Tensor | None = None,
                   scale: float | None = None, block_size: int = 512) -> torch.Tensor:
    """Attention of this ring rank's queries over the whole (ring-sharded) sequence. Differentiable in
    q, k, v and sinks.

    q [B, Hq, Sr, D], k/v [B, Hkv, Sr, D] hold the tokens `layout.ring_indices(rank)` (Sr = padded_len / size);
    sinks [Hq] (optional) are per-head sink logits; returns [B, Hq, Sr, D] in q's dtype.
    """
    if size > 1 and group is None:
        raise ValueError(f"ring attention over {size} ranks needs the ring process group (mesh.ring_group)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Ring.apply(q, k, v, sinks, layout, group, rank, size, scale, block_size)
