"""Variable-length attention over packed rows without flash-attn: cost Σ len², not row_len².

A packed row lays many sequences end to end (position ids restart at 0 for each). A dense attention over
the row, even masked block-diagonally, pays for every (query, key) pair of the row: a 2,300-token row of
forty 60-token sequences costs ~40× what its sequences cost. flash-attn's varlen kernel avoids that on
GPUs; this module does it with plain `scaled_dot_product_attention`, on CPU or GPU:

- sequences are grouped by length (longest first; a bucket takes sequences at least `fill` × its longest),
- each bucket is gathered into a right-padded [b, H, T, D] batch and runs one causal SDPA (right padding
  needs no mask under causality: a real query never sees a later position),
- outputs are scattered back to the row's order. Gather and scatter are index ops, so autograd flows
  through them and through SDPA's own fused backward.

Attention then costs Σ_buckets b·T² ≤ Σ len² / fill², and a handful of SDPA calls per layer. GPT-OSS-style
sinks join each bucket's softmax as one extra key (score `sink`, value 0) through an additive mask.

    layout = VarlenLayout.from_position_ids(position_ids)      # once per packed row
    out = varlen_attention(q, k, v, layout, scale=d ** -0.5)   # q [1, Hq, L, D], k/v [1, Hkv, L, D]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Bucket:
    gather: torch.Tensor  # [b, T] row positions to read (padding repeats the sequence's last token)
    valid: torch.Tensor  # [b, T] bool: real tokens (padding is computed and dropped)
    length: int  # T


@dataclass(frozen=True)
class VarlenLayout:
    """Where each packed sequence sits in its row, grouped into length buckets."""

    row_len: int
    lengths: tuple[int, ...]  # of the sequences, in row order
    buckets: tuple[Bucket, ...]
    inverse: torch.Tensor  # [L]: row position -> its index in the buckets' concatenated valid outputs

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, fill: float = 0.75) -> VarlenLayout:
        """`position_ids` [1, L] (or [L]): a new sequence starts wherever the position is 0."""
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(pos == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError("packed position ids must start at 0 (each sequence counts from 0)")
        return cls.from_lengths([b - a for a, b in zip(starts, [*starts[1:], len(pos)], strict=True)],
                                device=pos.device, fill=fill)

    @classmethod
    def from_lengths(cls, lengths: list[int], *, device: torch.device | str = "cpu", fill: float = 0.75
                     ) -> VarlenLayout:
        if not 0 < fill <= 1:
            raise ValueError(f"fill must be in (0, 1], not {fill}")
        if any(n <= 0 for n in lengths):
            raise ValueError(f"sequence lengths must be positive: {lengths}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and lengths[i] >= fill * lengths[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        buckets, flat = [], []
        for g in groups:
            t = lengths[g[0]]
            steps = torch.arange(t)
            lens = torch.tensor([lengths[i] for i in g])
            gather = torch.tensor([offsets[i] for i in g])[:, None] + torch.minimum(steps[None], lens[:, None] - 1)
            valid = steps[None] < lens[:, None]
            buckets.append(Bucket(gather.to(device), valid.to(device), t))
            flat.append(gather[valid])
        row_len = offsets[-1]
        inverse = torch.empty(row_len, dtype=torch.long)
        inverse[torch.cat(flat)] = torch.arange(row_len)
        return cls(row_len, tuple(lengths), tuple(buckets), inverse.to(device))

    @property
    def dense_cost(self) -> int:
        """Query-key pairs a dense causal attention over the row computes."""
        return self.row_len * (self.row_len + 1) // 2

    @property
    def cost(self) -> int:
        """Query-key pairs this layout's buckets compute (causal), padding included."""
        return sum(int(b.gather.shape[0]) * b.length * (b.length + 1) // 2 for b in self.buckets)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, *,
                     scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each packed sequence over itself: q [1, Hq, L, D], k/v [1, Hkv, L, D] (grouped
    query heads allowed) -> [1, Hq, L, D]. `sinks` [Hq]: one extra softmax logit per head, value 0."""
    if q.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row (batch 1), got a batch of {q.shape[0]}")
    if q.shape[2] != layout.row_len:
        raise ValueError(f"the layout describes a row of {layout.row_len} tokens, the queries have {q.shape[2]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    outs = []
    for b in layout.buckets:
        # [1, H, L, D] -> [b, H, T, D]
        qb, kb, vb = (x[0][:, b.gather].transpose(0, 1) for x in (q, k, v))
        ob = _causal_sdpa(qb, kb, vb, scale, sinks)
        outs.append(ob.transpose(1, 2)[b.valid])  # [n_valid, Hq, D]
    out = torch.cat(outs)[layout.inverse]  # back to row order, [L, Hq, D]
    return out.transpose(0, 1)[None]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    b, h, t, d = q.shape
    if gqa:  # the float mask below is per query head: expand the KV heads to match
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    bias = torch.zeros(t, t, dtype=q.dtype, device=q.device).masked_fill(~causal, float("-inf"))
    bias = torch.cat([bias[None].expand(h, t, t), sinks.to(q.dtype)[:, None, None].expand(h, t, 1)], -1)
    zero = q.new_zeros(b, h, 1, d)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=bias[None], scale=scale)
