"""Swap the sparse MoE blocks of a Hugging Face model for `MoEBlock`s, weights copied.

Recognised structurally, so transformers is never imported here: a module with `gate.weight` [E, H],
`gate.top_k` and `experts.gate_up_proj` [E, 2F, H] / `experts.down_proj` [E, H, F] with a SiLU
activation — the grouped layout of transformers 5 for Mixtral and Qwen3-MoE. Parameter names do not
change (`…mlp.gate.weight`, `…mlp.experts.gate_up_proj`, `…mlp.experts.down_proj`), so the converted
model's state dict still loads into, and syncs to, the original architecture.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tidal.moe_fsdp.block import MoEBlock
from tidal.moe_fsdp.config import MoEConfig


def is_hf_sparse_moe(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (not isinstance(module, MoEBlock) and isinstance(getattr(gate, "weight", None), torch.Tensor)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def moe_config_of(module: nn.Module, *, recompute: bool = False) -> MoEConfig:
    """The `MoEConfig` that reproduces a Hugging Face sparse MoE block."""
    name = type(module).__name__
    if hasattr(module, "shared_expert") or hasattr(module, "shared_experts"):
        raise ValueError(f"{name} has a shared expert, which MoEBlock does not model yet; "
                         "convert models without shared experts (Mixtral, Qwen3-MoE)")
    if float(getattr(module, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"{name} uses router jitter noise {module.jitter_noise}; set the config's "
                         "router_jitter_noise=0 (MoEBlock routes deterministically)")
    act = getattr(module.experts, "act_fn", None)
    probe = torch.linspace(-4, 4, 9)
    if act is not None and not torch.allclose(act(probe), nn.functional.silu(probe)):
        raise ValueError(f"{name}'s experts use {type(act).__name__}; MoEBlock implements SwiGLU (silu) experts")
    experts, hidden = module.experts.gate_up_proj.shape[0], module.experts.gate_up_proj.shape[2]
    return MoEConfig(hidden_size=hidden, intermediate_size=module.experts.down_proj.shape[2],
                     num_experts=experts, top_k=int(module.gate.top_k), score="softmax",
                     normalize=bool(getattr(module.gate, "norm_topk_prob", True)),  # Mixtral always renormalises
                     recompute=recompute)


def convert_hf_moe(model: nn.Module, *, ep_group: dist.ProcessGroup | None = None,
                   recompute: bool = False) -> list[str]:
    """Replace every Hugging Face sparse MoE block in `model` (in place) by an `MoEBlock`; with an
    `ep_group`, each rank keeps only its own slice of the experts. Returns the replaced modules' names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not is_hf_sparse_moe(module):
            continue
        weight = module.gate.weight
        block = MoEBlock(moe_config_of(module, recompute=recompute), ep_group=ep_group, device=weight.device,
                         dtype=weight.dtype)
        mine = slice(block.local_experts.start, block.local_experts.stop)
        with torch.no_grad():
            block.gate.weight.copy_(weight)
            block.experts.gate_up_proj.copy_(module.experts.gate_up_proj[mine])
            block.experts.down_proj.copy_(module.experts.down_proj[mine])
        model.set_submodule(name, block)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"no sparse MoE block found in {type(model).__name__}: expected modules with "
                         "gate.weight and experts.gate_up_proj / experts.down_proj (transformers >= 5 layout)")
    return replaced
