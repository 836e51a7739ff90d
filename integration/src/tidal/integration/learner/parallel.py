"""The learner's parallelism beyond data parallel: sequence parallelism (tidal-seqpar) and expert
parallelism (tidal-moe-fsdp), chosen with `learner.parallel`.

Sequence parallelism (`sp = P`): the learner's W ranks form a dp × sp grid (W = dp · P, consecutive
ranks share a sequence). The P ranks of an SP group train the same micro-batches: each packed row is
split over them (`tidal.seqpar.plan_layout`: padding, zigzag over the ring, slices over Ulysses) and the
model's attention runs through `sp_attention` (sinks included). Each rank computes logits, logprobs and
entropy only at its own positions; those per-token values (a float or two per completion token, not
logits) are gathered over the group, so every rank of it computes the same loss of the whole micro-batch:
token means over the global valid tokens, sequence-level ratios and aggregations (GSPO, seq-mean) and
advantages are exactly those of one rank. Gradients: each rank backpropagates its own tokens' part;
their sum over the SP group is the micro-batch's gradient, and the backend's reduction over all W ranks
(FSDP2, or `reduce_grads` for the single backend) does the rest. Only SP rank 0 of a group talks to the
buffer (as data-parallel rank `dp_rank` of `dp`) and hands the batch to the others.

Expert parallelism (`ep = E > 1`, backend ``fsdp2``): the ranks form a ("dp", "ep") mesh, world = dp × E,
EP groups are consecutive ranks. Every MoE block's experts are split in E equal contiguous blocks over its
EP group (tokens travel to their experts with an all-to-all, tidal.moe_fsdp.ep) and FSDP-sharded over
"dp"; everything else is FSDP-sharded over all dp × E ranks, which are all data-parallel for it (each
rank trains its own share of the batch, as without EP). Gradients end up averaged over all ranks for
both kinds of parameter, so the loss scaling of the trainer is unchanged. Weight publishing gathers every
expert tensor back to full size (one at a time); checkpoints are per rank (`save_native`) and resume only
on the same world size and ep.

    par = ParallelConfig(sp=2, sp_mode="ring")
    sp = setup_sequence_parallel(par, backend)          # after dist.init_process_group; collective
    trainer = Trainer(backend, train_cfg, sp=sp)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.core.errors import ConfigError
from tidal.learner.config import ParallelConfig

if TYPE_CHECKING:
    import torch

    from tidal.integration.learner.data import Micro
    from tidal.seqpar import ShardLayout, SPMesh

FIELD = "learner.parallel"
SP_BACKENDS = ("single", "fsdp2")  # deepspeed's engine is not wired to the SP layout (untested): refused
SP_ATTENTION = ("auto", "tidal_sp")  # the attention implementation under sp > 1 is tidal-seqpar's


def model_config(model: str | Path) -> dict[str, Any]:
    """The model folder's config.json (what the checks read: heads, sliding windows, dropout)."""
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model's config {path}: {e}", field="model") from None


def _ulysses_fits(q_heads: int, kv_heads: int) -> list[int]:
    """Ulysses degrees that split the heads (seqpar's rule: divide the query heads, and the KV heads be
    a multiple or a divisor of the degree)."""
    return [u for u in range(1, q_heads + 1) if q_heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)]


def check_sequence_parallel(par: ParallelConfig, *, world: int, config: dict[str, Any], backend: str = "single",
                            attn: str = "auto") -> tuple[int, int]:
    """The (ulysses, ring) degrees of `par.sp` on `world` learner ranks for a model with HF `config`;
    ConfigError naming the field, the value and what works when they do not fit."""
    sp, mode = par.sp, par.sp_mode
    if sp < 1:
        raise ConfigError(f"{FIELD}.sp must be >= 1, got {sp}", field=f"{FIELD}.sp")
    if world % sp:
        raise ConfigError(f"{FIELD}.sp = {sp} needs the learner's ranks to be a multiple of it (dp x sp), but it "
                          f"has {world}: start {sp * max(1, world // sp)} or {sp * (world // sp + 1)} ranks "
                          f"(launch nproc) or pick sp among {[d for d in range(1, world + 1) if world % d == 0]}",
                          field=f"{FIELD}.sp")
    if sp == 1:
        return 1, 1
    if backend not in SP_BACKENDS:
        raise ConfigError(f"{FIELD}.sp = {sp} runs with the learner backends {list(SP_BACKENDS)}, not {backend!r}",
                          field="learner.backend.name")
    if attn not in SP_ATTENTION:
        raise ConfigError(f"{FIELD}.sp = {sp} runs attention through tidal-seqpar (\"tidal_sp\": the row split over "
                          f"the SP ranks); learner.backend.options.attn = {attn!r} cannot attend over a split row: set it to "
                          f"\"auto\"", field="learner.backend.options.attn")
    text = config.get("text_config") or config
    q = int(text.get("num_attention_heads") or 0)
    kv = int(text.get("num_key_value_heads") or q)
    sliding = [t for t in (text.get("layer_types") or []) if "sliding" in str(t)]
    if sliding or (text.get("use_sliding_window") and text.get("sliding_window")):
        raise ConfigError(f"{FIELD}.sp = {sp}: the model has sliding-window attention layers ({len(sliding) or 'all'}), "
                          f"which tidal-seqpar does not implement; use sp = 1 for this model", field=f"{FIELD}.sp")
    if float(text.get("attention_dropout") or 0.0):
        raise ConfigError(f"{FIELD}.sp = {sp}: attention dropout {text['attention_dropout']} is not supported under "
                          f"sequence parallelism; set the model's attention_dropout to 0", field=f"{FIELD}.sp")
    if not q:
        raise ConfigError("the model's config has no num_attention_heads: cannot plan sequence parallelism",
                          field=f"{FIELD}.sp")
    fits = _ulysses_fits(q, kv)
    if mode == "ring":
        return 1, sp
    if mode == "ulysses":
        if sp not in fits:
            raise ConfigError(f"{FIELD}.sp = {sp} with sp_mode = \"ulysses\" cannot split the model's {q} query heads / "
                              f"{kv} KV heads (the degree must divide the query heads, and the KV heads be a multiple "
                              f"or a divisor of it): Ulysses degrees that work are {fits}; sp_mode = \"ring\" takes any "
                              f"degree, and \"hybrid\" puts the part the heads cannot take on the ring",
                              field=f"{FIELD}.sp")
        return sp, 1
    if mode == "hybrid":  # Ulysses inside as far as the heads allow, ring across
        inner = [u for u in fits if 1 < u < sp and sp % u == 0]
        if not inner:
            raise ConfigError(f"{FIELD}.sp = {sp} with sp_mode = \"hybrid\" needs a Ulysses degree u with 1 < u < sp "
                              f"dividing sp and the heads ({q} query / {kv} KV heads: {fits}), the ring taking sp / u; "
                              f"there is none: use sp_mode = \"ulysses\" or \"ring\"", field=f"{FIELD}.sp_mode")
        return max(inner), sp // max(inner)
    raise ConfigError(f"{FIELD}.sp_mode must be \"ulysses\", \"ring\" or \"hybrid\", not {mode!r}",
                      field=f"{FIELD}.sp_mode")


def check_parallel(par: ParallelConfig, *, world: int, config: dict[str, Any], backend: str = "single",
                   attn: str = "auto") -> None:
    """Every `learner.parallel` check, before a model is loaded (ConfigError naming the field)."""
    check_sequence_parallel(par, world=world, config=config, backend=backend, attn=attn)
    if par.sp > 1 and par.ep > 1:
        raise ConfigError(f"{FIELD}: sp = {par.sp} and ep = {par.ep} together are not supported yet (each is tested "
                          f"alone); use one of them", field=FIELD)
    try:
        ep_backend_options(par, backend, world)
    except ValueError as e:
        raise ConfigError(str(e), field=f"{FIELD}.ep") from None


@dataclass
class Shard:
    """This rank's part of one packed micro-batch under sequence parallelism."""

    micro: Micro  # this rank's tokens: ids, positions, the row's ShardLayout; pred/targets/processing of the
    # completion tokens whose logits this rank computes (pred: local positions)
    sel: list[torch.Tensor]  # per SP rank, which of the micro-batch's N completion tokens it scores
    mesh: SPMesh

    @property
    def layout(self) -> ShardLayout:
        # heavy: torch; the driver imports this module to check a recipe's layout
        from tidal.seqpar import ShardLayout

        layout = self.micro.layout
        assert isinstance(layout, ShardLayout)  # `SequenceParallel.shard` made it
        return layout

    def gather(self, *cols: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values of this rank's completion tokens ([n_me] each) -> the whole micro-batch's
        ([N] each, on every SP rank). Differentiable: see `_Gather`."""
        # heavy: torch; the driver imports this module to check a recipe's layout
        import torch

        # even an empty piece stays in the graph: its backward must reach this rank's attention collectives
        out = _gather(torch.stack([c.float() for c in cols], 1), self.sel, self.mesh)
        return list(out.unbind(1))

    def rows(self, x: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """This rank's rows of a per-row-position tensor [row_len, ...] (e.g. recorded MoE routes)."""
        # heavy: torch; the driver imports this module to check a recipe's layout
        from tidal.seqpar import shard

        return shard(x, self.layout, self.mesh, dim=0, pad_value=pad_value)


def _gather(x: torch.Tensor, sel: list[torch.Tensor], mesh: SPMesh) -> torch.Tensor:
    # heavy: torch; the driver imports this module to check a recipe's layout
    import torch
    import torch.distributed as dist

    class _Gather(torch.autograd.Function):
        """All SP ranks' [n_r, C] pieces -> [N, C] in completion-token order. Backward: every SP rank
        computes the same loss from the same gathered values, so the gradient w.r.t. the whole [N, C] is
        the same on all of them; each passes on its own rows only, and the parameter gradients the
        ranks accumulate sum to the loss's gradient (no reduction here: the backend's does it)."""

        @staticmethod
        def forward(ctx, piece: torch.Tensor) -> torch.Tensor:
            width = max(len(s) for s in sel)
            total = sum(len(s) for s in sel)
            out = piece.new_empty(total, piece.shape[1])
            if width == 0:
                return out
            buf = piece.new_zeros(width, piece.shape[1])
            buf[: len(piece)] = piece
            parts = [torch.empty_like(buf) for _ in sel]
            dist.all_gather(parts, buf, group=mesh.group)
            for part, s in zip(parts, sel, strict=True):
                out[s] = part[: len(s)]
            return out

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad[sel[mesh.rank]]

    return _Gather.apply(x)


@dataclass
class SequenceParallel:
    """This rank's place in the learner's dp × sp grid and what it does differently there."""

    mesh: SPMesh
    dp_rank: int  # which data-parallel share of each batch this rank's SP group trains
    dp: int  # number of SP groups (data-parallel degree)
    world: int  # dp * sp

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def leader(self) -> bool:
        """SP rank 0 of its group: the one that requests batches from the buffer and acknowledges them."""
        return self.mesh.rank == 0

    def share(self, obj: Any) -> Any:
        """The SP group leader's `obj` on every rank of the group (pickled; a batch's samples)."""
        # heavy: torch; the driver imports this module to check a recipe's layout
        import torch.distributed as dist

        box = [obj]
        group = self.mesh.group
        assert group is not None, "an SP group of more than one rank shares a batch"
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def shard(self, micro: Micro) -> Shard:
        """Split a packed micro-batch (one row, samples each one segment: no shared prompts) over the
        SP group: this rank's tokens, and which completion tokens' logits each rank computes (the rank
        holding the position that predicts it)."""
        # heavy: torch; the driver imports this module to check a recipe's layout
        import torch

        from tidal.integration.learner.data import Micro
        from tidal.seqpar import plan_layout, shard

        mesh, dev = self.mesh, micro.input_ids.device
        if micro.input_ids.shape[0] != 1:
            raise ValueError(f"a packed micro-batch is one row, got {micro.input_ids.shape[0]}")
        layout = plan_layout(micro.tokens, mesh, position_ids=micro.position_ids.cpu())
        local_len = layout.padded_len // mesh.size
        where = torch.empty(layout.padded_len, dtype=torch.long)  # row position -> rank * local_len + local index
        for r in range(mesh.size):
            where[layout.rank_indices(r // mesh.ulysses, r % mesh.ulysses)] = r * local_len + torch.arange(local_len)
        pred = micro.pred.cpu() if micro.pred is not None else torch.zeros(0, dtype=torch.long)
        flat = where[pred]
        owner = flat // local_len
        sel = [torch.nonzero(owner == r).flatten() for r in range(mesh.size)]
        mine = sel[mesh.rank]
        local = Micro(
            shard(micro.input_ids, layout, mesh, dim=1), shard(micro.position_ids, layout, mesh, dim=1),
            micro.index, micro.spans, layout=layout, pred=(flat[mine] % local_len).to(dev),
            targets=micro.targets[mine.to(dev)] if micro.targets is not None else None,
            processing=micro.processing.select(mine) if micro.processing is not None else None)
        return Shard(local, [s.to(dev) for s in sel], mesh)

    def reduce_grads(self, backend: Any) -> None:
        """Average gradients over all ranks, as FSDP2 does, for a backend that does not (single)."""
        average_grads(backend, self.world)


def average_grads(backend: Any, world: int) -> None:
    """Average gradients over all `world` ranks, as FSDP2 does, for a backend that does not (single, the
    replicas of plain data parallelism): with the trainer's scaling (x world) that makes every replica's
    gradient the whole batch's, so every replica takes the same step. One all-reduce per dtype over the
    flattened gradients (a parameter no micro-batch reached counts as zero)."""
    if getattr(backend, "reduces_grads", False) or world <= 1:
        return
    # heavy: torch; the driver imports this module to check a recipe's layout
    import torch
    import torch.distributed as dist

    params = [p for p in backend.model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[Any, list[Any]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def setup_sequence_parallel(par: ParallelConfig, backend: Any) -> SequenceParallel | None:
    """Check `par` against the backend's model and world, build the dp × sp mesh (collective: every rank
    calls it) and switch the model's attention to tidal-seqpar's. None when sp = 1."""
    # heavy: torch; the driver imports this module to check a recipe's layout
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    module = backend._module()
    ulysses, ring = check_sequence_parallel(par, world=world, config=module.config.to_dict(),
                                            backend=getattr(backend, "name", "single"), attn=backend.cfg.attn)
    if par.sp == 1:
        return None
    # heavy: torch; the driver imports this module to check a recipe's layout
    from tidal.seqpar import make_mesh
    from tidal.seqpar.hf import enable_sequence_parallel

    mesh = make_mesh(ulysses=ulysses, ring=ring)
    enable_sequence_parallel(module, mesh)
    return SequenceParallel(mesh=mesh, dp_rank=dist.get_rank() // par.sp, dp=world // par.sp, world=world)


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
        raise ValueError(f"learner.parallel.ep={ep} needs learner.backend.name = \"fsdp2\" (experts sharded over a "
                         f"(dp, ep) mesh under FSDP2), not {backend!r}")
    if world % ep:
        raise ValueError(f"learner.parallel.ep={ep} does not divide the learner's {world} ranks (world = dp × ep); "
                         f"with {world} ranks use ep in {_divisors(world)}, or start a multiple of {ep} ranks "
                         "(--nproc)")
    return {"ep": ep}


def check_ep_model(module: torch.nn.Module, ep: int, world: int) -> None:
    """Refuse, naming the constraint, a model that `ep` cannot split: no MoE blocks, or experts that do
    not divide evenly (the error lists the degrees that work with this model and world size)."""
    # heavy: torch; the driver imports this module to check a recipe's layout
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
    # heavy: torch; the driver imports this module to check a recipe's layout
    from tidal.moe_fsdp.fsdp import moe_mesh

    return moe_mesh(ep, device.type)


def ep_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors with the Hugging Face names, one at a time: FSDP shards gathered over their mesh,
    expert slices over their EP group (tidal-moe-fsdp's `iter_full_weights` over the state dict;
    collective: every rank iterates to the end in step; rank 0, which publishes, holds each full tensor
    only until the next is gathered)."""
    # heavy: torch; the driver imports this module to check a recipe's layout
    from tidal.moe_fsdp.fsdp import iter_full_weights

    return iter_full_weights(model, state=True)


def ep_clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global gradient norm (and clipping to `max_norm` unless it is inf) for parameters whose local
    shards partition them over all ranks: FSDP shards of the dense parameters over dp × ep, FSDP shards
    over dp of each EP rank's own experts. torch's clip_grad_norm_ cannot mix DTensors of two meshes,
    and would count an expert slice as the whole tensor."""
    # heavy: torch; the driver imports this module to check a recipe's layout
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
    # heavy: torch; the driver imports this module to check a recipe's layout
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
    # heavy: torch; the driver imports this module to check a recipe's layout
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
    state = torch.load(folder / f"rank-{rank}.pt", weights_only=True)  # never unpickle code from a file
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
