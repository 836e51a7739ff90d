"""The learner's parallelism: sequence parallelism (tidal-seqpar) and expert parallelism (tidal-moe-fsdp)
over the learner's ranks, chosen by `learner.parallel`.

Expert parallelism (`ep = E > 1`, backend ``fsdp2``): the ranks form a ("dp", "ep") mesh, world = dp × E,
EP groups are consecutive ranks. Every MoE block's experts are split in E equal contiguous blocks over its
EP group (tokens travel to their experts with an all-to-all, tidal.moe_fsdp.ep) and FSDP-sharded over
"dp"; everything else is FSDP-sharded over all dp × E ranks, which are all data-parallel for it (each
rank trains its own share of the batch, as without EP). Gradients end up averaged over all ranks for
both kinds of parameter, so the loss scaling of the trainer is unchanged. Weight publishing gathers every
expert tensor back to full size (one at a time); checkpoints are per rank (`save_native`) and resume only
on the same world size and ep.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tidal.core.config import ConfigStruct

if TYPE_CHECKING:
    import torch


class ParallelConfig(ConfigStruct):
    sp: int = 1  # sequence-parallel degree (tidal-seqpar)
    sp_mode: Literal["ulysses", "ring", "hybrid"] = "ulysses"
    ep: int = 1  # expert-parallel degree (tidal-moe-fsdp)


# --------------------------------------------------------------------------- expert parallelism (ep)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_backend_options(parallel: ParallelConfig, backend: str, world: int) -> dict[str, Any]:
    """The train backend's keyword arguments for `parallel.ep` ({} for ep = 1), after checking what the
    config alone can tell: a backend that implements EP, and an ep that divides the world size."""
    ep = parallel.ep
    if ep < 1:
        raise ValueError(f"learner.parallel.ep={ep} must be >= 1 (1 = no expert parallelism)")
    if ep == 1:
        return {}
    if backend != "fsdp2":
        raise ValueError(f"learner.parallel.ep={ep} needs learner.backend = \"fsdp2\" (experts sharded over a "
                         f"(dp, ep) mesh under FSDP2), not {backend!r}")
    if world % ep:
        raise ValueError(f"learner.parallel.ep={ep} does not divide the learner's {world} ranks (world = dp × ep); "
                         f"with {world} ranks use ep in {_divisors(world)}, or start a multiple of {ep} ranks "
                         "(--nproc)")
    return {"ep": ep}


def check_ep_model(module: torch.nn.Module, ep: int, world: int) -> None:
    """Refuse, naming the constraint, a model that `ep` cannot split: no MoE blocks, or experts that do
    not divide evenly (the error lists the degrees that work with this model and world size)."""
    from tidal.moe_fsdp.hf import is_hf_sparse_moe, moe_config_of

    blocks = [m for m in module.modules() if is_hf_sparse_moe(m)]
    if not blocks:
        raise ValueError(f"learner.parallel.ep={ep} but {type(module).__name__} is a dense model (no sparse MoE "
                         "block to split over experts); use ep = 1, or an MoE model (Mixtral, Qwen3-MoE, GPT-OSS)")
    experts = {moe_config_of(b).num_experts for b in blocks}
    bad = sorted(e for e in experts if e % ep)
    if bad:
        n = min(experts)
        works = [d for d in _divisors(n) if all(e % d == 0 for e in experts) and world % d == 0]
        raise ValueError(f"learner.parallel.ep={ep} does not divide the model's {bad[0]} experts per layer (each EP "
                         f"rank holds experts / ep of them); on {world} ranks ep can be one of {works}")


def ep_mesh(ep: int, device: torch.device):
    """The ("dp", "ep") device mesh over the default process group."""
    from tidal.moe_fsdp.fsdp import moe_mesh

    return moe_mesh(ep, device.type)


def _expert_names(model: torch.nn.Module) -> dict[str, Any]:
    """Fully qualified name of every expert parameter → its MoE block."""
    from tidal.moe_fsdp.replay import moe_blocks

    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(b)]}.experts.{p}": b for b in moe_blocks(model) for p, _ in b.experts.named_parameters()}


def ep_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors with the Hugging Face names, one at a time: FSDP shards gathered over their mesh,
    expert slices over their EP group (collective: every rank iterates to the end in step; rank 0, which
    publishes, holds each full tensor only until the next is gathered)."""
    import torch
    import torch.distributed as dist

    owner = _expert_names(model)
    for name, p in model.state_dict().items():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        block = owner.get(name)
        if block is not None and block.ep_size > 1:
            parts = [torch.empty_like(full) for _ in range(block.ep_size)]
            dist.all_gather(parts, full.contiguous(), group=block.ep_group)
            full = torch.cat(parts)
            del parts
        yield name, full


def ep_clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm (and clipping to `max_norm` unless it is inf) for parameters whose local
    shards partition them over all ranks: FSDP shards of the dense parameters over dp × ep, FSDP shards
    over dp of each EP rank's own experts. torch's clip_grad_norm_ cannot mix DTensors of two meshes,
    and would count an expert slice as the whole tensor."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.zeros((), dtype=torch.float64, device=local[0].device if local else "cpu")
    for g in local:
        sq += g.detach().double().square().sum()
    dist.all_reduce(sq)
    norm = sq.sqrt().float()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if max_norm != float("inf") and float(coef) < 1.0:
        for g in local:
            g.mul_(coef.to(g.dtype))
    return norm


def _local(x: Any) -> Any:
    """Checkpoint state with every DTensor replaced by this rank's shard (what only this rank holds)."""
    if hasattr(x, "to_local"):
        return x.to_local().detach().clone()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_local(v) for v in x)
    return x.detach().clone() if hasattr(x, "detach") else x


def ep_save(path: str, model: torch.nn.Module, optimizer: Any, scheduler: Any, ep: int) -> None:
    """Each rank writes its own shards (model, optimizer state) to <path>/rank-<r>.pt; rank 0 the layout."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    params = [p for _, p in model.named_parameters()]
    state = {"model": _local(model.state_dict()), "scheduler": scheduler.state_dict(),
             "optim_state": [_local(optimizer.state.get(p, {})) for p in params],
             "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
    torch.save(state, folder / f"rank-{rank}.pt")
    if rank == 0:
        (folder / "layout.json").write_text(json.dumps({"world": world, "ep": ep}))


def ep_load(path: str, model: torch.nn.Module, optimizer: Any, scheduler: Any, ep: int) -> None:
    """Restore what `ep_save` wrote, on the same world size and ep (each rank reads only its own file)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(path)
    layout = json.loads((folder / "layout.json").read_text())
    if layout != {"world": world, "ep": ep}:
        raise ValueError(f"the checkpoint at {path} was written by {layout['world']} ranks with ep={layout['ep']}; "
                         f"this learner has {world} ranks with ep={ep}: resume with the same learner.parallel.ep "
                         "and --nproc")
    state = torch.load(folder / f"rank-{rank}.pt", weights_only=False)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            (t.to_local() if isinstance(t, DTensor) else t).copy_(state["model"][name])
    params = [p for _, p in model.named_parameters()]
    for p, saved in zip(params, state["optim_state"], strict=True):
        if not saved:
            continue
        restored = {}
        for k, v in saved.items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0:
                v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            restored[k] = v
        optimizer.state[p] = restored
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)
    scheduler.load_state_dict(state["scheduler"])
