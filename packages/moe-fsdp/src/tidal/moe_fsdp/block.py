"""The MoE block: router → dropless sort-by-expert dispatch → grouped experts (local or expert-parallel)
→ combine weighted by router probabilities. A drop-in for a Hugging Face sparse MoE block."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tidal.moe_fsdp.config import MoEConfig
from tidal.moe_fsdp.dispatch import combine, sort_by_expert
from tidal.moe_fsdp.ep import run_experts_parallel
from tidal.moe_fsdp.experts import GroupedExperts
from tidal.moe_fsdp.gpt_oss import GptOssGroupedExperts
from tidal.moe_fsdp.router import TopKRouter, load_balancing_loss, router_z_loss


class MoEBlock(nn.Module):
    """`forward(hidden [..., H]) → [..., H]`; for layout "gpt_oss" `(out [..., H], router scores [T, k])`,
    the pair transformers' GPT-OSS decoder layer unpacks from its MLP.

    Parameters (names and layouts as Hugging Face stores them), with E_local = E / ep_size experts on this
    rank, global experts [ep_rank·E_local, (ep_rank+1)·E_local):
    - layout "mixtral" (Mixtral / Qwen3-MoE): `gate.weight` [E, H]; `experts.gate_up_proj` [E_local, 2F, H];
      `experts.down_proj` [E_local, H, F];
    - layout "gpt_oss": `router.weight` [E, H], `router.bias` [E]; `experts.gate_up_proj` [E_local, H, 2F]
      (gate/up interleaved), `experts.gate_up_proj_bias` [E_local, 2F], `experts.down_proj` [E_local, F, H],
      `experts.down_proj_bias` [E_local, H] (see `tidal.moe_fsdp.gpt_oss`).
    `top_k_router` is the router under either name.

    After each forward the block keeps, for the caller's loss and for routing replay statistics:
    `aux_loss` (load balancing, scalar), `z_loss` (router z-loss, scalar), `routes` [T, k] (experts used)
    and `router_routes` [T, k] (experts the router would pick; differs from `routes` only under replay).
    """

    def __init__(self, config: MoEConfig, *, ep_group: dist.ProcessGroup | None = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.config = config
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if config.num_experts % ep:
            raise ValueError(f"num_experts={config.num_experts} does not split evenly over an EP group of {ep} "
                             "ranks; choose an ep size that divides the number of experts")
        self.ep_size = ep
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        oss = config.layout == "gpt_oss"
        self.router_name = "router" if oss else "gate"  # the Hugging Face name, so state dicts line up
        self.add_module(self.router_name, TopKRouter(
            config.hidden_size, config.num_experts, config.top_k, score=config.score, normalize=config.normalize,
            bias=oss, device=device, dtype=dtype))
        local = config.num_experts // ep
        self.experts: GroupedExperts | GptOssGroupedExperts
        if oss:
            self.experts = GptOssGroupedExperts(local, config.hidden_size, config.intermediate_size,
                                                alpha=config.swiglu_alpha, limit=config.swiglu_limit,
                                                recompute=config.recompute, device=device, dtype=dtype)
        else:
            self.experts = GroupedExperts(local, config.hidden_size, config.intermediate_size,
                                          recompute=config.recompute, device=device, dtype=dtype)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None
        self.router_routes: torch.Tensor | None = None
        self._forced: torch.Tensor | None = None

    @property
    def top_k_router(self) -> TopKRouter:
        """The router (`gate` or `router`, as the layout names it)."""
        router = self._modules[self.router_name]
        assert isinstance(router, TopKRouter)
        return router

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds."""
        n = self.experts.num_experts
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def force_routes(self, routes: torch.Tensor | None) -> None:
        """Routing replay: the next forwards use `routes` [T, k] (expert ids; rows with an id < 0 are
        routed by the router). `None` returns the choice to the router."""
        self._forced = routes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [T, H]
        r = self.top_k_router(x, self._forced)
        order, counts = sort_by_expert(r.ids, self.config.num_experts)
        x_sorted = x.index_select(0, order // self.config.top_k)  # [T·k, H] grouped by expert
        if self.ep_group is None:
            y_sorted = self.experts(x_sorted, counts.tolist())
        else:
            y_sorted = run_experts_parallel(self.experts, x_sorted, counts, self.ep_group)
        probs = r.probs if self.config.score == "softmax" else r.probs / r.probs.sum(-1, keepdim=True)
        self.aux_loss = load_balancing_loss(probs, r.ids, self.config.num_experts)
        self.z_loss = router_z_loss(r.logits)
        self.routes, self.router_routes = r.ids.detach(), r.chosen.detach()
        out = combine(y_sorted, order, r.weights).reshape(shape)
        return (out, r.weights) if self.config.layout == "gpt_oss" else out
