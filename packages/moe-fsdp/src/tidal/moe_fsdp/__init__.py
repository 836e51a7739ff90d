"""tidal-moe-fsdp: MoE blocks with expert parallelism under FSDP2, memory-lean dispatch, routing replay."""

from tidal.moe_fsdp.block import MoEBlock
from tidal.moe_fsdp.config import MoEConfig
from tidal.moe_fsdp.dispatch import combine, sort_by_expert
from tidal.moe_fsdp.ep import all_to_all, run_experts_parallel
from tidal.moe_fsdp.experts import GroupedExperts
from tidal.moe_fsdp.fsdp import iter_full_weights, moe_mesh, shard_moe_model
from tidal.moe_fsdp.gpt_oss import GptOssGroupedExperts, clamped_swiglu
from tidal.moe_fsdp.hf import convert_hf_moe, is_hf_sparse_moe, moe_config_of
from tidal.moe_fsdp.reference import dense_moe
from tidal.moe_fsdp.replay import (
    moe_blocks,
    replay_routing,
    router_routes,
    routes_for_sequence,
    routing_mismatch,
    used_routes,
)
from tidal.moe_fsdp.router import Routing, TopKRouter, load_balancing_loss, router_z_loss

__all__ = [
    "GptOssGroupedExperts",
    "GroupedExperts",
    "MoEBlock",
    "MoEConfig",
    "Routing",
    "TopKRouter",
    "all_to_all",
    "clamped_swiglu",
    "combine",
    "convert_hf_moe",
    "dense_moe",
    "is_hf_sparse_moe",
    "iter_full_weights",
    "load_balancing_loss",
    "moe_blocks",
    "moe_config_of",
    "moe_mesh",
    "replay_routing",
    "router_routes",
    "router_z_loss",
    "routes_for_sequence",
    "routing_mismatch",
    "run_experts_parallel",
    "shard_moe_model",
    "sort_by_expert",
    "used_routes",
]
