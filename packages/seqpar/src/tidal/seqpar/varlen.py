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

Shared prefixes (`from_items`): the G samples of a GRPO group share their prompt. A row may hold the prompt
once and then each completion, every completion attending to the prompt's keys and to its own, causally
(`Item(prefix=..., start=..., length=...)`): the prompt's tokens are computed once instead of G times,
and each completion's logits equal those of prompt + completion packed alone.

    layout = VarlenLayout.from_position_ids(position_ids)      # once per packed row
    out = varlen_attention(q, k, v, layout, scale=d ** -0.5)   # q [1, Hq, L, D], k/v [1, Hkv, L, D]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Item:
    """One attention segment of a packed row: queries at row positions [start, start + length), keys at
    [prefix_start, prefix_start + prefix) (a shared prefix, e.g. the group's prompt) then the queries' own
    positions, causally (own token i sees the whole prefix and own tokens 0..i)."""

    start: int
    length: int
    prefix_start: int = 0
    prefix: int = 0


@dataclass(frozen=True)
class Bucket:
    gather: torch.Tensor  # [b, Tq] row positions of the queries (padding repeats the item's last token)
    valid: torch.Tensor  # [b, Tq] bool: real queries (padding is computed and dropped)
    length: int  # Tq
    keys: torch.Tensor | None = None  # [b, Tk] row positions of the keys, when items have a prefix
    mask: torch.Tensor | None = None  # [b, 1, Tq, Tk] bool, with `keys`: which keys each query sees


@dataclass(frozen=True)
class VarlenLayout:
    """Where each packed segment sits in its row, grouped into length buckets."""

    row_len: int
    items: tuple[Item, ...]  # in row order of their queries
    buckets: tuple[Bucket, ...]
    inverse: torch.Tensor  # [L]: row position -> its index in the buckets' concatenated valid outputs

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, fill: float = 0.75) -> VarlenLayout:
        """`position_ids` [1, L] (or [L]): a new sequence starts wherever the position is 0 (plain packing;
        shared prefixes cannot be read from position ids: build those with `from_items`)."""
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(pos == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError("packed position ids must start at 0 (each sequence counts from 0)")
        return cls.from_lengths([b - a for a, b in zip(starts, [*starts[1:], len(pos)], strict=True)],
                                device=pos.device, fill=fill)

    @classmethod
    def from_lengths(cls, lengths: list[int], *, device: torch.device | str = "cpu", fill: float = 0.75
                     ) -> VarlenLayout:
        """Sequences laid end to end, each attending to itself."""
        items, start = [], 0
        for n in lengths:
            items.append(Item(start, n))
            start += n
        return cls.from_items(items, device=device, fill=fill)

    @classmethod
    def from_items(cls, items: list[Item], *, device: torch.device | str = "cpu", fill: float = 0.75
                   ) -> VarlenLayout:
        """Segments whose queries tile the row exactly once (checked)."""
        if not 0 < fill <= 1:
            raise ValueError(f"fill must be in (0, 1], not {fill}")
        if any(it.length <= 0 or it.prefix < 0 for it in items):
            raise ValueError(f"segment lengths must be positive: {items}")
        span = lambda it: it.prefix + it.length  # noqa: E731  (keys seen by its last query)
        order = sorted(range(len(items)), key=lambda i: (-span(items[i]), items[i].prefix > 0))
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            if g and span(items[i]) >= fill * span(items[g[0]]) and (items[i].prefix > 0) == (items[g[0]].prefix > 0):
                g.append(i)
            else:
                groups.append([i])
        buckets, flat = [], []
        for g in groups:
            its = [items[i] for i in g]
            lens = np.array([it.length for it in its])[:, None]
            tq = int(lens.max())
            steps = np.arange(tq)[None]
            gather = np.array([it.start for it in its])[:, None] + np.minimum(steps, lens - 1)
            valid = steps < lens
            keys = mask = None
            if any(it.prefix for it in its):
                keys, mask = (x.to(device) for x in _prefix_keys(its, tq))
            buckets.append(Bucket(torch.from_numpy(gather).to(device), torch.from_numpy(valid).to(device), tq,
                                  keys, mask))
            flat.append(gather[valid])
        row_len = sum(it.length for it in items)
        covered = np.concatenate(flat) if flat else np.zeros(0, np.int64)
        if len(covered) != row_len or not np.array_equal(np.sort(covered), np.arange(row_len)):
            raise ValueError("the segments' queries must cover every row position exactly once")
        inverse = np.empty(row_len, dtype=np.int64)
        inverse[covered] = np.arange(row_len)
        return cls(row_len, tuple(items), tuple(buckets), torch.from_numpy(inverse).to(device))

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(it.length for it in self.items)

    @property
    def dense_cost(self) -> int:
        """Query-key pairs a dense causal attention over the row computes."""
        return self.row_len * (self.row_len + 1) // 2

    @property
    def cost(self) -> int:
        """Query-key pairs this layout's buckets compute (causal), padding included."""
        out = 0
        for b in self.buckets:
            n, t = int(b.gather.shape[0]), b.length
            out += n * t * int(b.keys.shape[1]) if b.keys is not None else n * t * (t + 1) // 2
        return out


def _prefix_keys(items: list[Item], tq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions [b, Tk] (prefix, then own tokens; padding repeats a real key and is masked) and the
    mask [b, 1, Tq, Tk]: query i sees every prefix key and its own keys 0..i (a padded query sees what
    the item's last query sees, so no row is empty). Built in numpy: this runs once per row per step."""
    pmax = max(it.prefix for it in items)
    tk = pmax + tq
    pre_len = np.array([it.prefix for it in items])[:, None]
    own_len = np.array([it.length for it in items])[:, None]
    col = np.arange(tk)[None]
    own_idx = np.clip(col - pmax, 0, own_len - 1)  # [b, Tk] own token index of each key column
    keys = np.where(col < pre_len, np.array([it.prefix_start for it in items])[:, None] + col,
                    np.array([it.start for it in items])[:, None] + own_idx)
    q = np.minimum(np.arange(tq)[None], own_len - 1)  # [b, Tq] (padded queries repeat the last)
    is_own = (col >= pmax) & (col - pmax < own_len)  # [b, Tk]
    mask = (col < pre_len)[:, None, :] | (is_own[:, None, :] & (own_idx[:, None, :] <= q[:, :, None]))
    return torch.from_numpy(keys), torch.from_numpy(mask[:, None])


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
        qb = q[0][:, b.gather].transpose(0, 1)
        keys = b.gather if b.keys is None else b.keys
        kb, vb = (x[0][:, keys].transpose(0, 1) for x in (k, v))
        ob = _causal_sdpa(qb, kb, vb, scale, sinks, b.mask)
        outs.append(ob.transpose(1, 2)[b.valid])  # [n_valid, Hq, D]
    out = torch.cat(outs)[layout.inverse]  # back to row order, [L, Hq, D]
    return out.transpose(0, 1)[None]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                 sinks: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, Hq, Tq, D], k/v [b, Hkv, Tk, D]; `mask` [b, 1, Tq, Tk] (True = attend), else plain causal."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    b, h, t, d = q.shape
    if gqa:  # the float mask below is per query head: expand the KV heads to match
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None, None].expand(b, 1, t, t)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = torch.cat([bias.expand(b, h, t, -1), sinks.to(q.dtype)[None, :, None, None].expand(b, h, t, 1)], -1)
    zero = q.new_zeros(b, h, 1, d)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=bias, scale=scale)
