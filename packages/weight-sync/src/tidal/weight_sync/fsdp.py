"""Sending a sharded (FSDP2 / DTensor) model without materialising it whole on one rank.

Every rank of the model's process group iterates `full_weights` (each DTensor is all-gathered, one
tensor at a time: a collective); only rank 0 receives the full tensors and packs them into buckets.

    ann = sync_from_sharded(sender, model, version)   # on every rank; the announcement on rank 0
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.core.protocol import WeightsAvailable


def full_weights(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of the state dict, gathered one at a time; yields on rank 0
    only, but every rank must run it to the end (the gathers are collectives)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            yield name, full.detach()
        del full  # free the gathered copy before gathering the next one


def sync_from_sharded(sender, model: torch.nn.Module, version: int,
                      group: dist.ProcessGroup | None = None) -> WeightsAvailable | None:
    """Run on every rank: rank 0 sends the full weights through `sender` (None elsewhere)."""
    weights = full_weights(model, group)
    if (dist.get_rank(group) if dist.is_initialized() else 0) == 0:
        return sender.send(weights, version)
    for _ in weights:  # drive the collectives on the other ranks
        pass
    return None
