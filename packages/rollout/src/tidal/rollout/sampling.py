"""The sampler's processing of logits, shared by the engines and by teacher-forced checks.

`process_logits` turns raw next-token logits into the *processed* log-distribution the sampler draws
from: divide by temperature, keep the top-k, keep the top-p nucleus, renormalise. The logprob an engine
reports for a token is that distribution's value at the token, so a learner can recompute it exactly
(`tidal.rollout.logprobs.teacher_forced_logprobs`) and importance ratios compare like with like.

Temperature 0 means greedy: the processed distribution is a point mass (logprob 0 for the argmax).
Ties at the top-k / top-p boundary are kept (every logit equal to the cut-off value survives).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tidal.core.protocol import SamplingParams


def _column(values: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, device=device, dtype=dtype).unsqueeze(1)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Processed log-probabilities [n, V] (fp32; removed entries are -inf) for rows of `logits` [n, V],
    row i processed under `params[i]`."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"process_logits wants logits [n, V] and n sampling params, got {tuple(logits.shape)} "
                         f"and {len(params)}")
    x = logits.float()
    vocab = x.shape[1]
    temps = [p.temperature for p in params]
    greedy = [t <= 0.0 for t in temps]
    x = x / _column([t if t > 0 else 1.0 for t in temps], x.device, x.dtype)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if any(greedy):
        ks = [1 if g else k for k, g in zip(ks, greedy, strict=True)]
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        sorted_x, _ = torch.sort(x, dim=-1, descending=True)
        if any(k < vocab for k in ks):
            kth = sorted_x.gather(1, torch.tensor(ks, device=x.device).sub(1).unsqueeze(1))
            x = torch.where(x < kth, neg_inf, x)
            sorted_x = torch.where(sorted_x < kth, neg_inf, sorted_x)
        if any(p < 1.0 for p in ps):
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each sorted entry
            top_p = _column(ps, x.device, x.dtype)
            keep_sorted = before < top_p  # the smallest prefix whose mass reaches top_p (first always kept)
            # cut-off value per row: the smallest kept sorted logit
            last = keep_sorted.sum(dim=1, keepdim=True).clamp(min=1) - 1
            cutoff = sorted_x.gather(1, last)
            x = torch.where(x < cutoff, neg_inf, x)
    return torch.log_softmax(x, dim=-1)


def sample(logprobs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row from processed `logprobs` [n, V]; row i uses `generators[i]` (a per-request
    generator makes a seeded request reproducible whatever else is in the batch). Uses the
    exponential-race form of categorical sampling: argmax(p / E), E ~ Exp(1)."""
    probs = logprobs.exp()
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return torch.argmax(probs / noise, dim=-1)


def kept_mask_bits(logprobs: torch.Tensor) -> np.ndarray:
    """The vocabulary entries the processing kept, as packed bits [n, ceil(V/8)] (uint8, big-endian bit
    order as `numpy.packbits`). The learner unpacks it to replay the same top-k/top-p support."""
    return np.packbits(torch.isfinite(logprobs).cpu().numpy(), axis=-1)


def unpack_kept_mask(bits: np.ndarray, vocab: int) -> np.ndarray:
    """Inverse of `kept_mask_bits`: bool [n, vocab]."""
    return np.unpackbits(bits, axis=-1, count=vocab).astype(bool)
