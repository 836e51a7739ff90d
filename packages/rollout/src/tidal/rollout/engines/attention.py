"""The embedded engine's attention: its own KV cache, reached through transformers' attention registry.

Per layer a `[max_num_seqs, kv_heads, max_model_len, head_dim]` cache whose first `n` rows are the `n`
running sequences. The engine sets the step's layout (`_ctx.step`) before each forward; the registered
attention function (`attn_implementation="tidal_packed"`) writes the new keys/values into their rows and
attends each sequence to its own context: decoding sequences batched, fresh prefills batched by length,
the rest (prefills on top of cached tokens) one by one.

GPT-OSS-style attention sinks (`s_aux`, one logit per query head) join every softmax as one extra key
whose score is the sink and whose value is 0 (an additive float mask over a zero key column): exactly
the eager reference's `softmax([scores, sink])[:-1]`. Sliding-window layers are refused, never widened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

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
    # [n_decode, max] keep-mask of the decode context, or None when every context is decode_max long
    # (sequences of a group step in lockstep, and an unmasked attention is the cheaper kernel)
    decode_mask: torch.Tensor | None = None
    # fresh prefills (past 0) of one length, attended as one batch: their packed indices [n, m] each;
    # the spans they cover are not in `single` (see `group_fresh_spans`)
    batched: list[torch.Tensor] | None = None
    single: list[tuple[int, int, int, int]] | None = None  # the other spans, one attention call each


def group_fresh_spans(spans: list[tuple[int, int, int, int]], device: torch.device
                      ) -> tuple[list[torch.Tensor], list[tuple[int, int, int, int]]]:
    """Fresh prefills of the same length attend as one batch (a group's prompts are one length), so
    a step of many short prompts costs one attention call per length, not one per prompt."""
    by_len: dict[int, list[tuple[int, int, int, int]]] = {}
    single = []
    for span in spans:
        if span[3] == 0:
            by_len.setdefault(span[1], []).append(span)
        else:
            single.append(span)
    batched = []
    for m, group in by_len.items():
        if len(group) == 1:
            single.extend(group)
            continue
        starts = torch.tensor([g[0] for g in group], device=device)
        batched.append(starts[:, None] + torch.arange(m, device=device)[None, :])
    return batched, single


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

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy rows `src` to rows `dst` (disjoint), positions below `length` only: nothing later is read."""
        if not src:
            return
        device = next(iter(self.k.values())).device if self.k else None
        if device is None:
            return
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        with torch.inference_mode():  # the cache is made inside inference mode
            for cache in (self.k, self.v):
                for t in cache.values():
                    t[d, :, :length] = t[s, :, :length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, gqa: bool,
          mask: torch.Tensor | None = None, causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA, q [B, Hq, m, D], k/v [B, Hkv, n, D]; `mask` bool [B | 1, 1, m, n] (True = attend) or `causal`
    (m == n); `sinks` [Hq]: one extra logit per head with value 0 in every row's softmax."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=gqa)
    b, h, m, d = q.shape
    n = k.shape[2]
    if gqa:  # the float mask below is per query head: give every query head its KV head
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)[None, None] if causal else \
            torch.ones(1, 1, m, n, dtype=torch.bool, device=q.device)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = torch.cat([bias.expand(b, h, m, n), sinks.to(q.dtype)[None, :, None, None].expand(b, h, m, 1)], -1)
    zero = q.new_zeros(b, h, 1, d)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), attn_mask=bias,
                                          scale=scale)


def _packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    step: _StepLayout | None = getattr(_ctx, "step", None)
    if step is None:
        raise RuntimeError("the tidal_packed attention runs only inside the embedded engine's loop; load the "
                           "model with attn_implementation='sdpa' to use it elsewhere")
    if sliding_window is not None:
        raise ValueError(f"layer {module.layer_idx} uses sliding-window attention (window {sliding_window}), "
                         "which the embedded engine does not implement; use vLLM, or a config whose layer_types "
                         "are all 'full_attention'")
    sinks = None if s_aux is None else s_aux.detach()
    kc, vc = step.cache.layer(module.layer_idx, key)
    # query/key/value: [1, heads, N, head_dim] -> write the new keys/values into their rows
    kc[step.slots, :, step.positions] = key[0].transpose(0, 1)
    vc[step.slots, :, step.positions] = value[0].transpose(0, 1)
    heads, head_dim = query.shape[1], query.shape[3]
    gqa = heads != key.shape[1]
    d = step.n_decode
    if d and not step.spans:  # pure decode: the common step
        return _decode_attention(query[0], kc, vc, step, scaling, gqa, sinks).unsqueeze(0), None
    out = query.new_empty((1, query.shape[2], heads, head_dim))
    if d:
        out[0, :d] = _decode_attention(query[0, :, :d], kc, vc, step, scaling, gqa, sinks)
    for idx in step.batched or ():  # fresh prefills of one length: the keys are this step's own
        n, m = idx.shape
        flat = idx.reshape(-1)
        q = query[0][:, flat].view(heads, n, m, head_dim).transpose(0, 1)
        k = key[0][:, flat].view(key.shape[1], n, m, head_dim).transpose(0, 1)
        v = value[0][:, flat].view(value.shape[1], n, m, head_dim).transpose(0, 1)
        o = _sdpa(q, k, v, causal=True, scale=scaling, gqa=gqa, sinks=sinks)
        out[0, flat] = o.permute(0, 2, 1, 3).reshape(n * m, heads, head_dim)
    for start, m, row, past in step.single if step.single is not None else step.spans:
        q = query[:, :, start : start + m]
        k, v = kc[row : row + 1, :, : past + m], vc[row : row + 1, :, : past + m]
        if past == 0:
            o = _sdpa(q, k, v, causal=True, scale=scaling, gqa=gqa, sinks=sinks)
        else:
            pos = past + torch.arange(m, device=q.device)
            mask = torch.arange(past + m, device=q.device)[None, :] <= pos[:, None]
            o = _sdpa(q, k, v, mask=mask, scale=scaling, gqa=gqa, sinks=sinks)
        out[0, start : start + m] = o[0].transpose(0, 1)
    return out, None


def _decode_attention(query: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step: _StepLayout,
                      scaling: float | None, gqa: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per decoding sequence against its cached context: [heads, d, hd] -> [d, heads, hd]."""
    q = query.transpose(0, 1).unsqueeze(2)  # [d, heads, 1, hd]
    length = step.decode_max
    if step.decode_rows is None:  # rows 0..d-1: a view, no copy
        k, v = kc[: step.n_decode, :, :length], vc[: step.n_decode, :, :length]
    else:
        k, v = kc[step.decode_rows, :, :length], vc[step.decode_rows, :, :length]
    mask = None if step.decode_mask is None else step.decode_mask[:, None, None, :]
    return _sdpa(q, k, v, mask=mask, scale=scaling, gqa=gqa, sinks=sinks)[:, :, 0]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention function masks by itself


def _register_attention() -> None:
    AttentionInterface.register(ATTN_IMPL, _packed_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
