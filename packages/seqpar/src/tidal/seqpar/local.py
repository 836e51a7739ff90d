"""Whole-sequence attention kernels for one rank (after the Ulysses all-to-all, without a ring):
torch SDPA on CPU or GPU, and flash-attn's varlen kernel on GPU. Both are differentiable through their
own autograd; the `math` backend (ring.py with one ring rank) is the reference and the sink-capable path.

Shapes: q [B, Hq, S, D], k/v [B, Hkv, S, D], segments [B, S] (the layout's, −1 = padding); out [B, Hq, S, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.seqpar.kernels import block_mask


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, *, causal: bool,
                   scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention under the segment (and causal) mask.

    Sinks [Hq] join the softmax as one extra key with score `sink` and value 0 (an additive float mask
    column), so SDPA's own backward gives the sink its gradient."""
    b, hq, s, d = q.shape
    rep = hq // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    idx = torch.arange(s, device=q.device)
    mask = block_mask(segments.to(q.device), idx, idx, causal)[:, None]  # [B, 1, S, S]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    zero = q.new_zeros(b, hq, 1, d)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = torch.cat([bias.expand(b, hq, s, s), sinks.to(q.dtype)[None, :, None, None].expand(b, hq, s, 1)], -1)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=bias, scale=scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, *, causal: bool,
                    scale: float) -> torch.Tensor:
    """flash-attn's `flash_attn_varlen_func` over the segments (packed sequences and padding become
    separate varlen sequences). CUDA with fp16/bf16 only; no sinks."""
    try:
        from flash_attn import flash_attn_varlen_func  # optional: the [flash-attn] extra, CUDA only
    except ImportError as e:
        raise ImportError("backend='flash' needs flash-attn (pip install 'tidal-seqpar[flash-attn]' on a CUDA "
                          "machine); use backend='sdpa' or 'math' elsewhere") from e
    b, hq, s, d = q.shape
    seg = segments.to(q.device)
    starts = torch.ones(b, s, dtype=torch.bool, device=q.device)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    begin = torch.nonzero(starts.reshape(-1)).flatten()
    cu = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] → [B·S, H, D]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], d)

    out = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, longest, longest, softmax_scale=scale,
                                 causal=causal)
    return out.reshape(b, s, hq, d).transpose(1, 2)
