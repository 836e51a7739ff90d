"""Block attention in plain torch: forward returning the log-sum-exp, and its backward.

These are the building blocks of ring attention (and of the `math` backend of local attention): a block
of queries against a block of keys under an explicit boolean mask, in fp32, with grouped-query heads
(query head h uses KV head h // (Hq / Hkv), as transformers' `repeat_kv` does). Rows that see no key
produce output 0 and lse −inf, never NaN.

Shapes: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], mask [B, Sq, Sk] (True = attend), out [B, Hq, Sq, D],
lse [B, Hq, Sq].
"""

from __future__ import annotations

import torch


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    b, h, s, d = q.shape
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} KV heads")
    return q.reshape(b, hkv, h // hkv, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scores [B, Hkv, G, Sq, Sk] in fp32 (masked entries −inf)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, k.shape[1]).float(), k.float()) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of a query block over a key block: (out [B, Hq, Sq, D] fp32, lse [B, Hq, Sq] fp32)."""
    b, h, sq, d = q.shape
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.float())
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B, Hq, Sq, D], dk, dv [B, Hkv, Sk, D], all fp32) of one block's share of attention
    whose final (all-block, sink-included) log-sum-exp is `lse` [B, Hq, Sq]; `delta` [B, Hq, Sq] is
    rowsum(dout · out) of the final output. The softmax probabilities are recomputed, not stored."""
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    s = _scores(q, k, mask, scale)
    lse_g = torch.where(torch.isinf(lse), 0.0, lse).reshape(b, hkv, h // hkv, sq, 1)
    p = torch.exp(s - lse_g)  # masked entries are exp(−inf) = 0
    do = _grouped(dout.float(), hkv)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.float())
    ds = p * (dp - delta.reshape(b, hkv, h // hkv, sq, 1)) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.float()).reshape(b, h, sq, d)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, hkv).float())
    return dq, dk, dv


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two normalised partial attentions over disjoint key sets (online softmax):
    out [..., S, D], lse [..., S] → the attention over the union."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    w, w_b = torch.exp(lse - safe), torch.exp(lse_b - safe)
    return out * w[..., None] + out_b * w_b[..., None], new


def block_mask(segments: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, Sq, Sk] bool: token q_idx[i] may attend to token k_idx[j] (same segment, and not later when
    causal). `segments` [B, S] are the layout's segment ids over global token indices."""
    m = segments[:, q_idx][:, :, None] == segments[:, k_idx][:, None, :]
    if causal:
        m = m & (k_idx[None, None, :] <= q_idx[None, :, None])
    return m
