"""Routing replay ("Keep Routing"): make the learner send every token to the experts the sampler used, so
the policy ratio compares the same computation, and measure how often the learner's router disagrees.

Layout: as tidal-rollout records it in `Trajectory.routing`, int16 [completion_len, layers, top_k]; the
learner places it at the positions that produced each completion token (`routes_for_sequence`) and
concatenates sequences in the order it flattens its batch. Unrecorded rows are -1 (router decides).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tidal.moe_fsdp.block import MoEBlock


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in layer order (the order of the routing array's layer axis)."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def routes_for_sequence(routing, prompt_len: int, seq_len: int) -> torch.Tensor:
    """Recorded completion routes [C, L, k] → [seq_len, L, k] for one sequence of prompt + completion.

    Completion token t was produced by position prompt_len - 1 + t, so its route sits there; every other
    position is -1 (not recorded: the router decides)."""
    routing = torch.as_tensor(routing).long()
    c, layers, k = routing.shape
    if prompt_len < 1 or prompt_len - 1 + c > seq_len:
        raise ValueError(f"{c} recorded routes do not fit a sequence of {seq_len} tokens with a "
                         f"{prompt_len}-token prompt; pass the sequence the routes were recorded for")
    out = torch.full((seq_len, layers, k), -1, dtype=torch.long)
    out[prompt_len - 1 : prompt_len - 1 + c] = routing
    return out


@contextmanager
def replay_routing(model: nn.Module, routing) -> Iterator[None]:
    """Within the block, every MoE layer of `model` uses the recorded routes.

    routing [T, L, k] (tensor or numpy, any int dtype), T = the tokens of each forward, flattened in the
    model's order (batch-major), L = the model's MoE layers in order."""
    blocks = moe_blocks(model)
    routing = torch.as_tensor(routing)
    if routing.dim() != 3 or routing.shape[1] != len(blocks):
        raise ValueError(f"routing has shape {tuple(routing.shape)}; this model needs [tokens, {len(blocks)} "
                         "layers, top_k] — the layout tidal-rollout records in Trajectory.routing")
    for i, block in enumerate(blocks):
        block.force_routes(routing[:, i].long())
    try:
        yield
    finally:
        for block in blocks:
            block.force_routes(None)


def used_routes(model: nn.Module) -> torch.Tensor:
    """Experts each token went to in the last forward, [T, L, k] int64 (the recorded ones under replay)."""
    return torch.stack([_ran(b.routes) for b in moe_blocks(model)], dim=1)


def router_routes(model: nn.Module) -> torch.Tensor:
    """Experts the router itself picked in the last forward, [T, L, k] int64, replay or not."""
    return torch.stack([_ran(b.router_routes) for b in moe_blocks(model)], dim=1)


def routing_mismatch(recorded, recomputed) -> torch.Tensor:
    """Per layer, the fraction of tokens whose expert *set* differs between two routings [T, L, k].
    Rows of `recorded` with an id < 0 (not recorded) are left out. → [L] float32."""
    a, b = torch.as_tensor(recorded).long(), torch.as_tensor(recomputed).long().to(torch.as_tensor(recorded).device)
    if a.shape != b.shape:
        raise ValueError(f"routings to compare have shapes {tuple(a.shape)} and {tuple(b.shape)}; "
                         "both must be [tokens, layers, top_k] over the same tokens")
    valid = (a >= 0).all(-1)  # [T, L]
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1) & valid
    return differs.sum(0).float() / valid.sum(0).clamp_min(1).float()


def _ran(routes: torch.Tensor | None) -> torch.Tensor:
    """A block's routes of its last forward (a block sets both kinds in each forward)."""
    if routes is None:
        raise RuntimeError("the model has not run a forward yet; routes exist only after one")
    return routes
