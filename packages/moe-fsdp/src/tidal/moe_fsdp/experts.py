"""Grouped SwiGLU experts over expert-sorted tokens, one expert at a time.

Memory: an expert's intermediates (its [n, 2F] gate/up projection and [n, F] activation) exist only
while that expert runs; its output is written into the shared [N, H] result and the intermediates are
dropped before the next expert starts. For backward we keep either the [N, 2F] projection (default) or,
with `recompute=True`, nothing but the inputs: backward recomputes each expert's projection just before
it needs it. Either way no [T, E, ...] tensor exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(h: torch.Tensor, grad_act: torch.Tensor) -> torch.Tensor:
    """d(silu(g)·u)/d[g, u] for h = [g, u] [n, 2F], grad_act [n, F] → [n, 2F]."""
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dsilu = sig * (1 + gate * (1 - sig))
    return torch.cat([grad_act * up * dsilu, grad_act * gate * sig], dim=-1)


class _GroupedSwiGLU(torch.autograd.Function):
    """x [N, H] sorted by expert, gate_up [E, 2F, H], down [E, H, F], counts (E ints) → [N, H]."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts: tuple[int, ...], recompute: bool):
        out = x.new_empty(x.shape[0], down.shape[1])
        keep = None if recompute else x.new_empty(x.shape[0], gate_up.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = x[start:start + n] @ gate_up[e].T  # [n, 2F]
                torch.matmul(_swiglu(h), down[e].T, out=out[start:start + n])
                if keep is not None:
                    keep[start:start + n] = h
                del h  # this expert's intermediates die here, before the next expert runs
            start += n
        ctx.counts = counts
        ctx.save_for_backward(x, gate_up, down, keep)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate_up, down, keep = ctx.saved_tensors
        grad_x = torch.zeros_like(x)
        grad_gate_up = torch.zeros_like(gate_up)
        grad_down = torch.zeros_like(down)
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                xs, go = x[start:start + n], grad_out[start:start + n]
                h = x[start:start + n] @ gate_up[e].T if keep is None else keep[start:start + n]
                torch.matmul(go.T, _swiglu(h), out=grad_down[e])  # [H, F]
                grad_h = _swiglu_backward(h, go @ down[e])  # [n, 2F]
                torch.matmul(grad_h.T, xs, out=grad_gate_up[e])  # [2F, H]
                torch.matmul(grad_h, gate_up[e], out=grad_x[start:start + n])
                del h, grad_h
            start += n
        return grad_x, grad_gate_up, grad_down, None, None


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts (the ones this rank holds) as two grouped weights, in the layout of
    Hugging Face transformers 5 (`experts.gate_up_proj`, `experts.down_proj`):

    gate_up_proj [E, 2F, H] — rows [:F] are the gate projection, rows [F:] the up projection;
    down_proj [E, H, F].

    `forward(x [N, H], counts)`: x sorted by expert, `counts[e]` rows for expert e → [N, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, recompute: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.recompute = recompute
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                  device=device, dtype=dtype))
        nn.init.normal_(self.gate_up_proj, std=hidden_size ** -0.5)
        nn.init.normal_(self.down_proj, std=intermediate_size ** -0.5)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
        if len(counts) != self.num_experts or sum(counts) != x.shape[0]:
            raise ValueError(f"counts {list(counts)} do not split {x.shape[0]} rows over {self.num_experts} "
                             "local experts; pass one count per local expert, summing to the rows of x")
        return _GroupedSwiGLU.apply(x, self.gate_up_proj, self.down_proj, tuple(counts), self.recompute)
