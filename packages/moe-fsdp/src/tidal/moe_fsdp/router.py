"""Top-k router: logits → probabilities → chosen experts and their combine weights; the two router losses.

Shapes: T tokens, H hidden, E experts, k = top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class Routing:
    """What the router decided for T tokens."""

    logits: torch.Tensor  # [T, E] raw router logits (input dtype)
    probs: torch.Tensor  # [T, E] float32 softmax or sigmoid of the logits
    ids: torch.Tensor  # [T, k] int64 experts the tokens go to (forced ones under routing replay)
    weights: torch.Tensor  # [T, k] combine weights at `ids`, from `probs` (renormalised if configured)
    chosen: torch.Tensor  # [T, k] int64 experts the router itself would pick (equals ids without replay)


class TopKRouter(nn.Module):
    """`weight` [E, H] (the layout of Hugging Face's `gate.weight`), and with `bias=True` a `bias` [E] (GPT-OSS's
    `router.bias`). `forward(x [T, H], forced [T, k] | None)`.

    `forced` is routing replay: rows whose ids are all >= 0 use those experts; a row with any id < 0 is
    "not recorded" and the router decides. The combine weights are always read from the current
    probabilities at the experts used, so the router keeps receiving gradients under replay.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 normalize: bool = True, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.score, self.normalize = num_experts, top_k, score, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=hidden_size ** -0.5)
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None) -> Routing:
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        probs = logits.float().softmax(-1) if self.score == "softmax" else logits.float().sigmoid()
        top, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        ids = chosen
        if forced is not None:
            forced = self._check_forced(forced, x.shape[0])
            recorded = (forced >= 0).all(-1, keepdim=True)  # [T, 1]
            ids = torch.where(recorded, forced, chosen)
            top = probs.gather(-1, ids)
        if self.normalize:
            top = top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(top.dtype).tiny)
        return Routing(logits=logits, probs=probs, ids=ids, weights=top.to(x.dtype), chosen=chosen)

    def _check_forced(self, forced: torch.Tensor, tokens: int) -> torch.Tensor:
        if tuple(forced.shape) != (tokens, self.top_k):
            raise ValueError(f"replayed routes have shape {tuple(forced.shape)}, this layer needs "
                             f"[tokens={tokens}, top_k={self.top_k}]; pass one [T, k] slice per layer, "
                             "aligned with the flattened tokens of this forward (use -1 for unrecorded tokens)")
        forced = forced.to(device=self.weight.device, dtype=torch.long)
        if forced.numel() and int(forced.max()) >= self.num_experts:
            raise ValueError(f"replayed expert id {int(forced.max())} is out of range for {self.num_experts} "
                             "experts; were the routes recorded with another model?")
        return forced


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch / Mixtral auxiliary loss: E · Σ_e f_e · P_e, with f_e the fraction of the T·k routed slots
    that went to expert e and P_e the mean router probability of e. Equals 1 for perfectly uniform routing.
    probs [T, E] float32, each row a distribution (normalise sigmoid scores first), ids [T, k] → scalar."""
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    frac = torch.bincount(ids.reshape(-1), minlength=num_experts).to(probs.dtype) / ids.numel()  # [E]
    return num_experts * (frac * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)², which keeps logits small.
    logits [T, E] → scalar (float32)."""
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
