"""Dropless dispatch: group the T·k (token, expert) slots by expert with one stable argsort.

No [T, E] one-hot is built; the only per-slot tensors are the permutation and the per-expert counts.
"""

from __future__ import annotations

import torch


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] → (order [T·k] int64, counts [E] int64).

    `order` lists the flattened slots (slot s = token s // k, choice s % k) grouped by expert, ascending;
    `counts[e]` is how many slots expert e received, so expert e's slots are
    `order[counts[:e].sum() : counts[:e+1].sum()]`. Stable, so a token's slots keep token order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"expert id {int(flat.max())} is out of range for {num_experts} experts")
    return order, counts


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo `sort_by_expert` and mix each token's k expert outputs with its router weights.

    y_sorted [T·k, H] (expert order), order [T·k], weights [T, k] → [T, H]."""
    tokens, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted.index_select(0, inverse).view(tokens, k, -1)  # [T, k, H] slot order
    return torch.bmm(weights.unsqueeze(1).to(y.dtype), y).squeeze(1)
