"""The embedded engine's attention: its own KV cache, reached through transformers' attention registry.

Per layer a `[max_num_seqs, kv_heads, max_model_len, head_dim]` cache whose first `n` rows are the `n`
running sequences. The engine sets the step's layout (`_ctx.step`) before each forward; the registered
attention function (`attn_implementation="tidal_packed"`) writes the new keys/values into their rows and
attends each sequence to its own context: decoding sequences batched, prefilling ones one by one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPL = "tidal_packed"

_ctx = threading.local()  # the step being computed, read by the attention function



# --------------------------------------------------------------------------- attention over our cache


@dataclass
class _StepLayout:
    """Where each packed token goes, for one forward pass. The first `n_decode` packed tokens are the
    single pending tokens of decoding sequences; the rest are the prefills of `spans`."""

    n_decode: int  # decoding sequences (one token each), first in the packed row
    decode_rows: torch.Tensor | None  # their cache rows, or None when they are rows 0..n_decode-1
    decode_lens: torch.Tensor  # [n_decode] their context length after this step
    decode_max: int  # the longest of those
    slots: torch.Tensor  # [N] cache row of each packed token
    positions: torch.Tensor  # [N] position of each packed token
    spans: list[tuple[int, int, int, int]]  # per prefilling sequence (packed start, tokens, cache row, past)
    cache: _KVCache


class _KVCache:
    def __init__(self, rows: int, max_len: int) -> None:
        self.rows = rows
        self.max_len = max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx not in self.k:
            shape = (self.rows, like.shape[1], self.max_len, like.shape[3])
            self.k[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.v[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.k[idx], self.v[idx]

    def move(self, src: int, dst: int) -> None:
        for cache in (self.k, self.v):
            for t in cache.values():
                with torch.inference_mode():  # the cache is made inside inference mode
                    t[dst].copy_(t[src])


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    step: _StepLayout | None = getattr(_ctx, "step", None)
    if step is None:
        raise RuntimeError("the tidal_packed attention runs only inside the embedded engine's loop; load the "
                           "model with attn_implementation='sdpa' to use it elsewhere")
    kc, vc = step.cache.layer(module.layer_idx, key)
    # query/key/value: [1, heads, N, head_dim] -> write the new keys/values into their rows
    kc[step.slots, :, step.positions] = key[0].transpose(0, 1)
    vc[step.slots, :, step.positions] = value[0].transpose(0, 1)
    heads, head_dim = query.shape[1], query.shape[3]
    gqa = heads != key.shape[1]
    d = step.n_decode
    if d and not step.spans:  # pure decode: the common step
        return _decode_attention(query[0], kc, vc, step, scaling, gqa).unsqueeze(0), None
    out = query.new_empty((1, query.shape[2], heads, head_dim))
    if d:
        out[0, :d] = _decode_attention(query[0, :, :d], kc, vc, step, scaling, gqa)
    for start, m, row, past in step.spans:
        q = query[:, :, start : start + m]
        k, v = kc[row : row + 1, :, : past + m], vc[row : row + 1, :, : past + m]
        if past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            pos = past + torch.arange(m, device=q.device)
            mask = torch.arange(past + m, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[0, start : start + m] = o[0].transpose(0, 1)
    return out, None


def _decode_attention(query: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step: _StepLayout,
                      scaling: float | None, gqa: bool) -> torch.Tensor:
    """One query token per decoding sequence against its cached context: [heads, d, hd] -> [d, heads, hd]."""
    q = query.transpose(0, 1).unsqueeze(2)  # [d, heads, 1, hd]
    length = step.decode_max
    if step.decode_rows is None:  # rows 0..d-1: a view, no copy
        k, v = kc[: step.n_decode, :, :length], vc[: step.n_decode, :, :length]
    else:
        k, v = kc[step.decode_rows, :, :length], vc[step.decode_rows, :, :length]
    mask = (torch.arange(length, device=q.device)[None, :] < step.decode_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)[:, :, 0]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention function masks by itself


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, _packed_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
