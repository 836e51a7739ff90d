"""Swap the sparse MoE blocks of a Hugging Face model for `MoEBlock`s, weights copied.

Recognised structurally, so transformers is never imported here:
- Mixtral / Qwen3-MoE (transformers 5's grouped layout): a module with `gate.weight` [E, H], `gate.top_k`
  and `experts.gate_up_proj` [E, 2F, H] / `experts.down_proj` [E, H, F] with a SiLU activation;
- GPT-OSS: `router.weight` [E, H], `router.bias` [E], `router.top_k`, and `experts.gate_up_proj` [E, H, 2F],
  `experts.gate_up_proj_bias`, `experts.down_proj` [E, F, H], `experts.down_proj_bias`, `experts.alpha`,
  `experts.limit` (the clamped SwiGLU).
Parameter names do not change (`…mlp.gate.weight` or `…mlp.router.weight`, `…mlp.experts.gate_up_proj`,
…), so the converted model's state dict still loads into, and syncs to, the original architecture.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.moe_fsdp.block import MoEBlock
from tidal.moe_fsdp.config import MoEConfig


def _tensor(module: object, name: str) -> bool:
    return isinstance(getattr(module, name, None), torch.Tensor)


def is_gpt_oss_moe(module: nn.Module) -> bool:
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    return (not isinstance(module, MoEBlock) and _tensor(router, "weight") and _tensor(router, "bias")
            and all(_tensor(experts, n) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
            and hasattr(experts, "alpha") and hasattr(experts, "limit"))


def is_hf_sparse_moe(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    mixtral = (not isinstance(module, MoEBlock) and _tensor(gate, "weight") and _tensor(experts, "gate_up_proj")
               and _tensor(experts, "down_proj"))
    return mixtral or is_gpt_oss_moe(module)


def moe_config_of(module: nn.Module, *, recompute: bool = False) -> MoEConfig:
    """The `MoEConfig` that reproduces a Hugging Face sparse MoE block."""
    name = type(module).__name__
    hf: Any = module  # its experts / gate / router attributes are the architecture's own
    if is_gpt_oss_moe(module):
        e, h, f2 = hf.experts.gate_up_proj.shape
        # GPT-OSS: softmax over the top-k logits = softmax over all, top-k, renormalised
        return MoEConfig(hidden_size=h, intermediate_size=f2 // 2, num_experts=e, top_k=int(hf.router.top_k),
                         score="softmax", normalize=True, recompute=recompute, layout="gpt_oss",
                         swiglu_alpha=float(hf.experts.alpha), swiglu_limit=float(hf.experts.limit))
    if _tensor(hf.experts, "gate_up_proj_bias") or _tensor(hf.gate, "bias"):
        raise ValueError(f"{name} has biased experts or router in a layout MoEBlock does not know; it models "
                         "Mixtral / Qwen3-MoE (no biases) and GPT-OSS (router.bias, experts.*_bias, alpha, limit)")
    if hasattr(module, "shared_expert") or hasattr(module, "shared_experts"):
        raise ValueError(f"{name} has a shared expert, which MoEBlock does not model yet; "
                         "convert models without shared experts (Mixtral, Qwen3-MoE)")
    if float(getattr(module, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"{name} uses router jitter noise {hf.jitter_noise}; set the config's "
                         "router_jitter_noise=0 (MoEBlock routes deterministically)")
    act = getattr(hf.experts, "act_fn", None)
    probe = torch.linspace(-4, 4, 9)
    if act is not None and not torch.allclose(act(probe), nn.functional.silu(probe)):
        raise ValueError(f"{name}'s experts use {type(act).__name__}; MoEBlock implements SwiGLU (silu) experts")
    experts, hidden = hf.experts.gate_up_proj.shape[0], hf.experts.gate_up_proj.shape[2]
    return MoEConfig(hidden_size=hidden, intermediate_size=hf.experts.down_proj.shape[2],
                     num_experts=experts, top_k=int(hf.gate.top_k), score="softmax",
                     normalize=bool(getattr(hf.gate, "norm_topk_prob", True)),  # Mixtral always renormalises
                     recompute=recompute)


def convert_hf_moe(model: nn.Module, *, ep_group: dist.ProcessGroup | None = None,
                   recompute: bool = False) -> list[str]:
    """Replace every Hugging Face sparse MoE block in `model` (in place) by an `MoEBlock`; with an
    `ep_group`, each rank keeps only its own slice of the experts. Returns the replaced modules' names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not is_hf_sparse_moe(module):
            continue
        config = moe_config_of(module, recompute=recompute)
        router = module.router if config.layout == "gpt_oss" else module.gate
        block = MoEBlock(config, ep_group=ep_group, device=router.weight.device, dtype=router.weight.dtype)
        mine = slice(block.local_experts.start, block.local_experts.stop)
        with torch.no_grad():
            for name_, p in block.top_k_router.named_parameters():
                p.copy_(getattr(router, name_))
            for name_, p in block.experts.named_parameters():  # this rank's slice of every expert tensor
                p.copy_(getattr(module.experts, name_)[mine])
        model.set_submodule(name, block)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"no sparse MoE block found in {type(model).__name__}: expected modules with "
                         "gate.weight and experts.gate_up_proj / experts.down_proj (transformers >= 5 layout), or "
                         "GPT-OSS's router.weight / router.bias and biased experts")
    return replaced
