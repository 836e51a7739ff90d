"""Losses and gradients under sequence parallelism: every rank scores only its own tokens, so the mean
must be taken over the valid tokens of all SP ranks, and replicated parameters' gradients summed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tidal.seqpar.mesh import SPMesh

IGNORE = -100


@dataclass(frozen=True, slots=True)
class SPLoss:
    """A token-mean loss split over SP ranks."""

    local: torch.Tensor  # this rank's share: Σ own token losses / valid tokens of all ranks; call .backward() on it
    value: torch.Tensor  # the global token-mean loss (same on every rank; no gradient), for logging
    tokens: int  # valid tokens over all SP ranks


def shift_labels(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] next-token targets for the full (unsharded) batch: target[t] = labels[t + 1] (labels default
    to input_ids), and IGNORE (−100) at the end of each row and of each packed sequence (where the next
    position id is not this one + 1). Shift before sharding: a rank does not hold its successor's token."""
    src = input_ids if labels is None else labels
    out = torch.full_like(src, IGNORE)
    out[:, :-1] = src[:, 1:]
    if position_ids is not None:
        out[:, :-1][position_ids[:, 1:] != position_ids[:, :-1] + 1] = IGNORE
    return out


def sp_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: SPMesh) -> SPLoss:
    """Token-mean cross entropy over all SP ranks, weighted by valid (≠ −100) tokens.

    logits [B, Sl, V] and targets [B, Sl] are this rank's shard (targets shifted before sharding, see
    `shift_labels`; padding carries −100). Backward on `.local` on every rank, then sum gradients over
    `mesh.group` (`sum_grads`, or the data-parallel reduction over a dp × sp mesh), gives the gradient
    of the global mean."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    stats = torch.stack([total.detach(), (targets != IGNORE).sum().to(total.dtype)])
    if mesh.size > 1:
        dist.all_reduce(stats, group=mesh.group)
    tokens = int(stats[1].item())
    denom = max(tokens, 1)
    return SPLoss(local=total / denom, value=stats[0] / denom, tokens=tokens)


def sum_grads(params: Iterable[torch.nn.Parameter], mesh: SPMesh) -> None:
    """Sum every parameter's `.grad` over the SP ranks in place (each rank holds its tokens' share).
    A parameter without a gradient on this rank contributes zeros."""
    if mesh.size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif not p.grad.is_contiguous():  # a collective reduces the memory, not the view
            p.grad = p.grad.contiguous()
        dist.all_reduce(p.grad, group=mesh.group)
