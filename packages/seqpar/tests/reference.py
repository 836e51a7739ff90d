"""Single-process references, written plainly and independently of the package's kernels."""

from __future__ import annotations

import torch


def segments_of(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] sequence number of each token: a new sequence starts at every position id 0."""
    starts = (position_ids == 0).long()
    starts[:, 0] = 0
    return starts.cumsum(1)


def attention(q, k, v, position_ids, *, causal: bool, sinks=None, scale=None):
    """Full [S, S] softmax attention; GQA by repeating KV heads; packed sequences by an explicit mask;
    sinks as an extra softmax column whose probability is dropped. q [B, Hq, S, D], k/v [B, Hkv, S, D]."""
    b, h, s, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(h // k.shape[1], 1)
    v = v.repeat_interleave(h // v.shape[1], 1)
    seg = segments_of(position_ids)
    allowed = seg[:, :, None] == seg[:, None, :]
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(b, h, s, 1)], -1)
    probs = scores.softmax(-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v
