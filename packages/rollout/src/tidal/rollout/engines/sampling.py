"""The sampler's processing of logits, shared by the engines and by teacher-forced checks.

`process_logits` turns raw next-token logits into the *processed* log-distribution the sampler draws
from: divide by temperature, keep the top-k, keep the top-p nucleus, renormalise. The logprob an engine
reports for a token is that distribution's value at the token, so a learner can recompute it exactly
(`tidal.rollout.engines.logprobs.teacher_forced_logprobs`) and importance ratios compare like with like.

Temperature 0 means greedy: the processed distribution is a point mass (logprob 0 for the argmax).
Ties at the top-k / top-p boundary are kept (every logit equal to the cut-off value survives).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tidal.core.protocol import SamplingParams


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Processed log-probabilities [n, V] (fp32; removed entries are -inf) for rows of `logits` [n, V],
    row i processed under `params[i]`."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"process_logits wants logits [n, V] and n sampling params, got {tuple(logits.shape)} "
                         f"and {len(params)}")
    dev = logits.device
    return processed_logprobs(logits, torch.tensor([p.temperature for p in params], device=dev),
                              torch.tensor([p.top_k for p in params], device=dev),
                              torch.tensor([p.top_p for p in params], device=dev))


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       kept: torch.Tensor | None = None) -> torch.Tensor:
    """The one definition of the sampler's processed distribution, for the engines and the learner alike:
    log-probabilities [n, V] (fp32, removed entries -inf, differentiable in `logits`) of rows `logits`
    [n, V], row i at temperature[i] (<= 0: greedy), top_k[i] (<= 0 or >= V: off) and top_p[i] (1: off).

    `kept` [n, V] bool, when given, is the vocabulary each row's sampler kept (Keep Sampling Mask): the
    row is renormalised over exactly that set instead of recomputing the top-k/top-p cut, which could
    differ from the sampler's by ties or by the last bits of the logits."""
    x = logits.float()
    vocab = x.shape[1]
    temperature = temperature.to(x.device, torch.float32)
    greedy = temperature <= 0.0
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    if kept is not None:
        return torch.log_softmax(torch.where(kept.to(x.device), x, neg_inf), dim=-1)
    k = top_k.to(x.device, torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    k = torch.where(greedy, torch.ones_like(k), k)
    p = top_p.to(x.device, torch.float32)
    cut_k, cut_p = bool((k < vocab).any()), bool((p < 1.0).any())
    if cut_k or cut_p:
        sorted_x, _ = torch.sort(x, dim=-1, descending=True)
        if cut_k:
            kth = sorted_x.gather(1, (k - 1)[:, None])
            x = torch.where(x < kth, neg_inf, x)
            sorted_x = torch.where(sorted_x < kth, neg_inf, sorted_x)
        if cut_p:
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each sorted entry
            keep_sorted = before < p[:, None]  # the smallest prefix whose mass reaches top_p (first always kept)
            last = keep_sorted.sum(dim=1, keepdim=True).clamp(min=1) - 1  # cut-off: the smallest kept logit
            cutoff = sorted_x.gather(1, last)
            x = torch.where(x < cutoff, neg_inf, x)
    return torch.log_softmax(x, dim=-1)


def processed_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy [n] of processed log-distributions [n, V] (removed entries, -inf, contribute 0),
    differentiable in `logp` (an entropy bonus in the loss) at the memory cost of `logp` alone."""
    return _Entropy.apply(logp)


def _finite(logp: torch.Tensor) -> torch.Tensor:
    """`logp` with -inf (a removed entry, probability 0) as the lowest float: p * log p is then 0 there."""
    return logp.clamp(min=torch.finfo(logp.dtype).min)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * _finite(logp)).sum(-1)


class _Entropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v over the kept entries; dH/dlog p_v = -p_v (log p_v + 1) there, 0 at removed
    ones. Backward recomputes p from the saved `logp`, which is log_softmax's output and kept by its own
    backward already: autograd's default would save p and a mask, two more [n, V] tensors per micro-batch."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logp: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logp)
        return _entropy(logp)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (logp,) = ctx.saved_tensors  # type: ignore[attr-defined]  # set by save_for_backward
        out = _finite(logp).add_(1.0)  # in place on fresh tensors: a [n, V] pass each, two allocations
        return out.mul_(logp.exp()).mul_(-grad[:, None])


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without overflowing int64."""
    return ((x & 0xFFFF) * c + (((x >> 16) * (c & 0xFFFF)) << 16)) & _M32


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), float64 [n, vocab]: entry (i, v) is a hash (murmur3's
    finaliser) of (seeds[i], counters[i], v). The same seed and counter give the same noise whatever
    else is in the batch and on any device, with one vectorised computation for all rows."""
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = (_mul32(seeds[:, None] & _M32, 0x9E3779B1) ^ _mul32(counters[:, None] & _M32, 0x85EBCA77)
         ^ _mul32(v[None, :], 0xC2B2AE3D))
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return (x.double() + 0.5) / 4294967296.0


def sample(logprobs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from processed `logprobs` [n, V]. Row i's randomness is a function of
    (seeds[i], counters[i]) only (see `uniform_noise`; the counter is the token's index in its
    completion), so a seeded request is reproducible whatever it is batched with. Exponential-race
    form of categorical sampling: argmax(log p - log E), E = -log U ~ Exp(1)."""
    exp_noise = -torch.log(uniform_noise(seeds, counters, logprobs.shape[1]))
    return torch.argmax(logprobs.double() - torch.log(exp_noise), dim=-1)


def kept_mask_bits(logprobs: torch.Tensor) -> np.ndarray:
    """The vocabulary entries the processing kept, as packed bits [n, ceil(V/8)] (uint8, big-endian bit
    order as `numpy.packbits`). The learner unpacks it to replay the same top-k/top-p support."""
    return np.packbits(torch.isfinite(logprobs).cpu().numpy(), axis=-1)


def unpack_kept_mask(bits: np.ndarray, vocab: int) -> np.ndarray:
    """Inverse of `kept_mask_bits`: bool [n, vocab]."""
    return np.unpackbits(bits, axis=-1, count=vocab).astype(bool)
