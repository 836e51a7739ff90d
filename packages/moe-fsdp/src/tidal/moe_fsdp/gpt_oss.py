"""GPT-OSS experts: the expert layout and activation of transformers' `GptOssExperts`, over expert-sorted
tokens (the `GroupedExperts` interface, so dispatch, expert parallelism, FSDP and replay are shared).

Layout (as transformers stores it, so names and shapes sync to the original model unchanged):
gate_up_proj [E, H, 2F] (x @ W: transposed against Mixtral's [E, 2F, H]) whose columns interleave gate
and up (gate = [..., 0::2], up = [..., 1::2]); gate_up_proj_bias [E, 2F]; down_proj [E, F, H];
down_proj_bias [E, H]. Activation, the clamped SwiGLU with alpha = 1.702, limit = 7 in GPT-OSS:
gate ← min(gate, limit), up ← clamp(up, −limit, limit), out = (up + 1) · gate · σ(alpha · gate).

The arithmetic is transformers' eager expert loop op for op (same matmuls, bias adds, clamps); autograd
differentiates it. With `recompute=True` each expert's forward is checkpointed: only its input rows are
kept for backward and its [n, 2F] projection is recomputed there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2F] interleaved (gate, up) columns → [n, F]."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssGroupedExperts(nn.Module):
    """`num_experts` GPT-OSS experts (the ones this rank holds). `forward(x [N, H], counts)`: x sorted by
    expert, `counts[e]` rows for expert e → [N, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float = 1.702,
                 limit: float = 7.0, recompute: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.alpha, self.limit, self.recompute = alpha, limit, recompute
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **kw))
        nn.init.normal_(self.gate_up_proj, std=hidden_size ** -0.5)
        nn.init.normal_(self.down_proj, std=intermediate_size ** -0.5)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        h = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2F]
        return clamped_swiglu(h, self.alpha, self.limit) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
        if len(counts) != self.num_experts or sum(counts) != x.shape[0]:
            raise ValueError(f"counts {list(counts)} do not split {x.shape[0]} rows over {self.num_experts} "
                             "local experts; pass one count per local expert, summing to the rows of x")
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                rows = x[start:start + n]
                outs.append(checkpoint(self._expert, rows, e, use_reentrant=False) if self.recompute
                            else self._expert(rows, e))
            start += n
        if not outs:  # no rows: still a (zero) gradient for every parameter, so sharded reductions line up
            return x.new_zeros(0, self.down_proj.shape[2]) + sum(p.sum() * 0 for p in self.parameters())
        return torch.cat(outs)
