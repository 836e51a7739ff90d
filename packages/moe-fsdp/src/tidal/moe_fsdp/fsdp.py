"""FSDP2 for MoE models on a 2-D ("dp", "ep") mesh, and full-weight gathering for weight sync.

Experts: split over "ep" (each rank holds E / ep of them, `MoEBlock`), then FSDP-sharded over "dp".
Dense layers (attention, norms, router, embeddings): FSDP-sharded over all dp × ep ranks, which are all
data-parallel for them. Every rank sees its own data; gradients are averaged over all ranks for both
kinds of parameter (an expert's gradient already sums the contributions of every EP rank's tokens, so
its FSDP reduction divides by dp × ep, not dp).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tidal.moe_fsdp.hf import convert_hf_moe
from tidal.moe_fsdp.replay import moe_blocks


def moe_mesh(ep_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A ("dp", "ep") mesh over the default group: world = dp × ep, EP groups are consecutive ranks."""
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the world size {world}")
    return init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))


def shard_moe_model(model: nn.Module, mesh: DeviceMesh, *, recompute: bool = False,
                    reshard_after_forward: bool = True, mp_policy=None) -> nn.Module:
    """Apply FSDP2 to a Hugging Face MoE model (in place) and return it.

    The model's sparse MoE blocks become `MoEBlock`s with experts split over mesh["ep"] (skipped if it
    already has MoEBlocks); each block's experts are one FSDP unit over mesh["dp"], each decoder layer
    holding a block one unit over the flattened mesh, the root (embeddings, head) the last."""
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("dp", "ep"):
        raise ValueError(f"shard_moe_model needs a 2-D mesh named ('dp', 'ep'), got {mesh}; build it with "
                         "moe_mesh(ep_size)")
    if not moe_blocks(model):
        convert_hf_moe(model, ep_group=mesh["ep"].get_group(), recompute=recompute)
    dense = mesh._flatten("dp_ep")  # all ranks: the dense layers' data-parallel group
    kw: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    names = {id(m): n for n, m in model.named_modules()}
    for block in moe_blocks(model):
        if block.ep_size != mesh["ep"].size():
            raise ValueError(f"a block was built for an EP group of {block.ep_size} ranks, the mesh's ep "
                             f"dimension has {mesh['ep'].size()}; convert with ep_group=mesh['ep'].get_group()")
        experts = fully_shard(block.experts, mesh=mesh["dp"], **kw)  # the same module, now an FSDPModule
        experts.set_gradient_divide_factor(float(mesh.size()))
        parent = names[id(block)].rpartition(".")[0]
        if parent:
            fully_shard(model.get_submodule(parent), mesh=dense, **kw)
    fully_shard(model, mesh=dense, **kw)
    return model


def iter_full_weights(model: nn.Module, *, grads: bool = False, state: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter, one at a time, with the names of the unsharded
    model (for MoE layers: the Hugging Face names). Gathers FSDP shards over their mesh and expert slices
    over the EP group, so every rank must iterate to the end in step; each tensor can be sent and dropped
    before the next is gathered, so at most one full parameter exists at a time. `grads=True` yields the
    parameters' reduced gradients instead (after backward; a parameter without one gives zeros).
    `state=True` walks the model's state dict instead of its parameters (persistent buffers included: what
    a checkpoint or a weight update carries)."""
    if state:
        names = {id(m): n for n, m in model.named_modules()}
        by_name = {f"{names[id(b)]}.experts.{n}": b for b in moe_blocks(model) for n, _ in b.experts.named_parameters()}
        items = [(name, t, by_name.get(name)) for name, t in model.state_dict().items()]
    else:
        owner = {id(p): b for b in moe_blocks(model) for p in b.experts.parameters()}
        items = [(name, (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p, owner.get(id(p)))
                 for name, p in model.named_parameters()]
    for name, t, block in items:
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if block is not None and block.ep_size > 1:
            parts = [torch.empty_like(full) for _ in range(block.ep_size)]
            dist.all_gather(parts, full.contiguous(), group=block.ep_group)
            full = torch.cat(parts)
            del parts
        yield name, full
