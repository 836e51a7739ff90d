"""The naive MoE layer, written the obvious way: every expert runs on every token and a dense [T, E]
weight matrix mixes the results. It is the correctness reference for tests and the memory baseline of
tools/bench/moe.py — never use it to train (it materialises E × T × 3F activations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """x [T, H], ids/weights [T, k], gate_up [E, 2F, H], down [E, H, F] → [T, H]."""
    h = torch.einsum("th,efh->etf", x, gate_up)  # [E, T, 2F]
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("etf,ehf->eth", F.silu(gate) * up, down)  # [E, T, H]
    mix = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device)
    mix = mix.scatter(1, ids, weights)  # [T, E], zero where a token does not visit the expert
    return torch.einsum("te,eth->th", mix.to(y.dtype), y)
