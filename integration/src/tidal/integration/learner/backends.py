"""Train backends (plugin kind ``train_backend``): who owns the model's parallelism.

- ``single``: one process, the model as it is.
- ``fsdp2``: `torch.distributed.fsdp.fully_shard` on every decoder layer and the root, over the default
  process group (gloo on CPU, NCCL on GPU), optional mixed precision and activation checkpointing; with
  `ep > 1` (`learner.parallel.ep`) MoE experts are split over a ("dp", "ep") mesh (see `parallel`).
- ``deepspeed`` (extra ``tidal[deepspeed]``): ZeRO-2 or ZeRO-3 through `deepspeed.initialize`.

Both take the same `BackendConfig`, build the model from a local Hugging Face folder (or take one),
and expose the same face to the learner: `model`, `forward(micro)`, `clip_and_step()`,
`named_weights()` (full tensors, gathered one at a time), `state_dict()` / `load_state_dict()` for
checkpoints (through torch.distributed.checkpoint, so sharded state is saved without gathering).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tidal.integration.learner.lora import (
    CHECKPOINT_OPTIONS,
    LOAD_OPTIONS,
    adapter_weights,
    add_lora,
    merged_weights,
)
from tidal.integration.learner.parallel import (
    ParallelConfig,
    check_ep_model,
    ep_backend_options,
    ep_clip_grad_norm,
    ep_load,
    ep_mesh,
    ep_named_weights,
    ep_save,
)
from tidal.learner.config import BackendConfig, LoraOptions, OptimConfig
from tidal.moe_fsdp.fsdp import shard_moe_model
from tidal.moe_fsdp.hf import convert_hf_moe, is_hf_sparse_moe
from tidal.seqpar.hf import ATTENTION_NAME, VARLEN_ATTENTION, register_varlen_attention


def pick_attention(requested: str, device: torch.device, sinks: bool = False) -> str:
    """`sinks`: the model has GPT-OSS-style attention sinks, which flash_attention_2 does not take; "auto"
    then picks tidal_varlen (sink-aware, exact backward) on every device."""
    if requested == VARLEN_ATTENTION:
        return register_varlen_attention()
    if requested != "auto":
        return requested
    if device.type == "cuda" and not sinks:
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"  # varlen from the position ids, in its own kernel
        except ImportError:
            pass
    return register_varlen_attention()


def lr_lambda(cfg: OptimConfig):
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    if cfg.schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"optim.schedule must be constant, linear or cosine, not {cfg.schedule!r}")
    return f


def has_sinks(model: str) -> bool:
    """Whether the model folder's architecture has attention sinks (GPT-OSS)."""
    config = Path(model) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "gpt_oss"


def _value_head(module: torch.nn.Module) -> torch.nn.Module | None:
    """The critic's head `value_head=True` added to the model, or None."""
    head = getattr(module, "value_head", None)
    return head if isinstance(head, torch.nn.Module) else None


class _Backend:
    name = "base"
    reduces_grads = False  # whether backward/step reduce gradients over the ranks (sharded backends)
    ep = 1  # expert-parallel degree (fsdp2 only)
    @property
    def native_checkpoints(self) -> bool:
        """True: checkpoints through save_native / load_native, not torch.distributed.checkpoint."""
        return False

    def __init__(self, model: str | torch.nn.Module, cfg: BackendConfig, device: str = "cpu",
                 lora: LoraOptions | None = None) -> None:
        self.cfg = cfg
        self.lora = lora  # adapters train, the base is frozen (lora.py); refused for the sharded backends
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        module: Any  # a transformers causal LM (its config; a value head added below)
        if isinstance(model, torch.nn.Module):
            module = model
        else:
            # heavy: transformers (seconds to import); only loading a model needs it
            from transformers import AutoModelForCausalLM

            module = AutoModelForCausalLM.from_pretrained(
                model, dtype=getattr(torch, cfg.dtype),
                attn_implementation=pick_attention(cfg.attn, self.device, sinks=has_sinks(model)))
        self.moe_layers = _convert_moe(module, self._ep_group(module)) if cfg.moe_blocks else 0
        if cfg.value_head:
            module.value_head = torch.nn.Linear(module.config.hidden_size, 1, dtype=getattr(torch, cfg.dtype))
            torch.nn.init.zeros_(module.value_head.weight)
            torch.nn.init.zeros_(module.value_head.bias)
        module.to(self.device)
        if cfg.grad_checkpointing:
            enable = getattr(module, "activation_checkpointing_enable", None) or module.gradient_checkpointing_enable
            enable()
        if lora is not None:
            module = add_lora(module, lora)
            if cfg.grad_checkpointing:  # the frozen embeddings' output must carry a gradient into each segment
                module.enable_input_require_grads()
        module.train()
        self.model = self._wrap(module)
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        o = self.cfg.optim
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, **self._optim_impl())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o))

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def _ep_group(self, module: torch.nn.Module) -> Any:
        """The process group MoE experts are split over (None: every rank holds all of them)."""
        return None

    def _optim_impl(self) -> dict[str, bool]:
        """One fused kernel for all parameters (CPU and CUDA) instead of a Python loop per tensor: the
        loop was a tenth of a small model's step. Sharded backends keep torch's default."""
        return {"fused": True} if self.device.type in ("cpu", "cuda") else {}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: Any = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [1, L, V] of a packed row (no attention mask, no cache: packing by position ids), or
        [1, N, V] at the N row positions `keep`. `layout`: the row's `VarlenLayout`, when the caller has
        it (saves deriving it in every layer)."""
        extra = {} if keep is None else {"logits_to_keep": keep}
        return self._call(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          **self.layout_kw(layout), **extra).logits

    def forward_with_values(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: Any = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, L, V], critic values [1, L]) of a packed row; needs `value_head`."""
        out = self._call(input_ids=input_ids, position_ids=position_ids, use_cache=False, output_hidden_states=True,
                         **self.layout_kw(layout))
        head = self._module().value_head
        return out.logits, head(out.hidden_states[-1]).squeeze(-1)

    @property
    def attention(self) -> str:
        """The policy's attention implementation (transformers' name: "tidal_varlen", "sdpa", ...)."""
        return str(getattr(self._module().config, "_attn_implementation", "") or "")

    def layout_kw(self, layout: Any) -> dict[str, Any]:
        """Forward kwargs for a packed row's layout (`tidal_varlen` reads a VarlenLayout, sequence-parallel
        `tidal_sp` this rank's ShardLayout; also for a reference model that runs the same attention)."""
        if layout is None:
            return {}
        if self.attention == ATTENTION_NAME:
            return {"sp_layout": layout}
        return {"varlen_layout": layout} if self.attention == VARLEN_ATTENTION else {}

    def _call(self, **kw: Any) -> Any:
        return self.model(**kw)

    def _module(self) -> Any:
        """The transformers model under the wrapping (its config, value head, ...)."""
        return self.model

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradient of one micro-batch (`last`: the step's final one)."""
        loss.backward()

    def clip_and_step(self, skip: bool = False) -> dict[str, float]:
        """Clip the accumulated gradient and step the optimizer and the LR schedule, unless `skip` (the
        step's loss was not finite) or the global gradient norm is not finite: then the gradient is
        dropped, nothing steps, and `train/skipped_nonfinite` is 1 (the same on every rank: the norm is
        global, and the caller's `skip` is decided from globally reduced metrics)."""
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return self._step_unless_nonfinite(norm, skip)

    def _step_unless_nonfinite(self, norm: torch.Tensor, skip: bool) -> dict[str, float]:
        lr = self.scheduler.get_last_lr()[0]
        skipped = skip or not bool(torch.isfinite(norm))
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(norm), "train/lr": float(lr), "train/skipped_nonfinite": float(skipped)}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What generators are sent: the policy's full weights, or with LoRA its adapters alone (the critic
        head stays here: generators do not have it)."""
        if self.lora is not None:
            yield from adapter_weights(self.model)
            return
        for name, p in self.model.state_dict().items():
            if not name.startswith("value_head."):
                yield name, p.detach()

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy as a Hugging Face folder holds it: full weights (with LoRA, the adapters merged)."""
        if self.lora is not None:
            yield from merged_weights(self.model)
            return
        yield from self.named_weights()

    # checkpoint state (torch.distributed.checkpoint-compatible); with LoRA the trainable parameters only
    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, **self._sd_options())
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.lora is not None:
            self._check_adapter_state(state["model"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       **({"options": LOAD_OPTIONS} if self.lora is not None else {}))
        self.scheduler.load_state_dict(state["scheduler"])

    def _sd_options(self) -> dict[str, Any]:
        return {"options": CHECKPOINT_OPTIONS} if self.lora is not None else {}

    def _check_adapter_state(self, model_sd: dict[str, Any]) -> None:
        """A LoRA checkpoint holds exactly this model's trainable parameters (one written with another
        `learner.lora`, or by full fine-tuning, is refused by name)."""
        want = set(get_state_dict(self.model, self.optimizer, options=CHECKPOINT_OPTIONS)[0])
        if set(model_sd) != want:
            extra, missing = sorted(set(model_sd) - want), sorted(want - set(model_sd))
            raise ValueError(f"this checkpoint does not hold the adapters learner.lora = {self.lora} trains: "
                             f"{len(missing)} of them missing (e.g. {missing[:2]}), {len(extra)} other tensors "
                             f"(e.g. {extra[:2]}). It was written with another learner.lora, or by full "
                             f"fine-tuning: resume with the settings it was written with")

    def save_native(self, path: str) -> None:
        raise NotImplementedError(f"the {self.name} backend checkpoints through torch.distributed.checkpoint "
                                  f"(native_checkpoints is False)")

    def load_native(self, path: str) -> None:
        raise NotImplementedError(f"the {self.name} backend checkpoints through torch.distributed.checkpoint "
                                  f"(native_checkpoints is False)")


def _convert_moe(module: torch.nn.Module, ep_group: Any = None) -> int:
    """Swap the model's Hugging Face sparse MoE blocks for MoEBlocks (experts split over `ep_group`, if
    any); the number of MoE layers."""
    if not any(is_hf_sparse_moe(m) for m in module.modules()):
        return 0
    return len(convert_hf_moe(module, ep_group=ep_group))


class SingleBackend(_Backend):
    name = "single"


class FSDP2Backend(_Backend):
    name = "fsdp2"
    reduces_grads = True

    def _optim_impl(self) -> dict[str, bool]:
        return {}  # DTensor parameters: torch picks its implementation

    def __init__(self, model: str | torch.nn.Module, cfg: BackendConfig, device: str = "cpu", ep: int = 1) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the fsdp2 backend needs torch.distributed initialised (gloo on CPU, nccl on GPU); "
                               "the learner launcher does this for every rank")
        self.ep, self.mesh = ep, None
        if ep > 1:
            ep_backend_options(ParallelConfig(ep=ep), self.name, dist.get_world_size())  # the config checks
            if not cfg.moe_blocks:
                raise ValueError(f"learner.parallel.ep={ep} needs learner.backend.options.moe_blocks = true (expert "
                                 "parallelism runs in tidal-moe-fsdp's MoEBlocks)")
            self.mesh = ep_mesh(ep, torch.device(device))
        super().__init__(model, cfg, device)

    def _ep_group(self, module: torch.nn.Module) -> Any:
        if self.mesh is None:
            return None

        check_ep_model(module, self.ep, self.world_size)
        return self.mesh["ep"].get_group()

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        kwargs: dict[str, Any] = {}
        if self.cfg.mixed_precision:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, self.cfg.mixed_precision),
                                                       reduce_dtype=torch.float32)
        if self.mesh is not None:  # experts over "ep" then "dp"; the rest over dp × ep (tidal.moe_fsdp.fsdp)
            if (head := _value_head(module)) is not None:
                fully_shard(head, mesh=self.mesh._flatten("dp_ep"), **kwargs)
            return shard_moe_model(module, self.mesh, mp_policy=kwargs.get("mp_policy"))
        layers = getattr(getattr(module, "model", module), "layers", None)
        if layers is None:
            raise ValueError(f"fsdp2: cannot find the decoder layers of {type(module).__name__} (model.layers)")
        for layer in layers:
            fully_shard(layer, **kwargs)
        if (head := _value_head(module)) is not None:  # called on its own (outside the root forward): its own unit
            fully_shard(head, **kwargs)
        fully_shard(module, **kwargs)
        return module

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, one at a time (every rank must iterate: the gathers are collective); under EP the
        expert slices are gathered over their EP group too."""
        if self.mesh is not None:
            weights = ep_named_weights(self.model)
        else:
            weights = ((n, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach())
                       for n, p in self.model.state_dict().items())
        for name, full in weights:
            if not name.startswith("value_head."):
                yield name, full

    def clip_and_step(self, skip: bool = False) -> dict[str, float]:
        if self.mesh is None:
            return super().clip_and_step(skip)

        clip = self.cfg.optim.grad_clip
        norm = ep_clip_grad_norm(list(self.model.parameters()), clip if clip > 0 else float("inf"))
        return self._step_unless_nonfinite(torch.as_tensor(norm), skip)

    @property
    def native_checkpoints(self) -> bool:
        """Under EP, checkpoints are per rank (`save_native` / `load_native`): the expert slices of one
        global name live on several ranks, which torch.distributed.checkpoint would take for one tensor."""
        return self.mesh is not None

    def save_native(self, path: str) -> None:
        ep_save(path, self.model, self.optimizer, self.scheduler, self.ep)

    def load_native(self, path: str) -> None:
        ep_load(path, self.model, self.optimizer, self.scheduler, self.ep)


class DeepSpeedBackend(_Backend):
    """DeepSpeed ZeRO-2 or ZeRO-3 (`zero_stage`) over the default process group. The optimizer is torch's
    AdamW handed to `deepspeed.initialize` (same numerics as the other backends, no op to compile);
    gradient clipping and the LR schedule run inside DeepSpeed's step. Checkpoints use DeepSpeed's own
    format (`save_checkpoint` / `load_checkpoint`)."""

    name = "deepspeed"
    reduces_grads = True
    native_checkpoints = True  # DeepSpeed's own format

    def __init__(self, model: str | torch.nn.Module, cfg: BackendConfig, device: str = "cpu",
                 zero_stage: int = 3) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the deepspeed backend needs torch.distributed initialised; the learner launcher "
                               "does this for every rank")
        if zero_stage not in (2, 3):
            raise ValueError(f"deepspeed zero_stage must be 2 or 3, not {zero_stage}")
        if torch.device(device).type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(1, torch.cuda.device_count() or 1)))
        self.zero_stage = zero_stage
        super().__init__(model, cfg, device)

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # deepspeed.initialize below owns the wrapping

    def _build_optimizer(self) -> None:
        # optional: the [deepspeed] extra
        import deepspeed

        o = self.cfg.optim
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": o.grad_clip if o.grad_clip > 0 else 0.0,
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        if self.cfg.mixed_precision == "bfloat16":
            ds_config["bf16"] = {"enabled": True}
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=ds_config, dist_init_required=False,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o)),
        )

    def _call(self, **kw: Any) -> Any:
        return self.engine(**kw)

    def _module(self) -> Any:
        return self.engine.module

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(self, skip: bool = False) -> dict[str, float]:
        """DeepSpeed clips and steps inside `engine.step`, and in fp32 applies a non-finite gradient as it
        is: a step whose loss is not finite (`skip`) is not handed to it; the partitioned gradient is
        dropped the way `engine.step` drops it after a step (the ZeRO optimizer's zero_grad). A finite loss
        whose gradient is not finite is stepped by DeepSpeed before its norm can be read: it is counted in
        `train/nonfinite_grad_applied`, not skipped."""
        lr = self.scheduler.get_last_lr()[0]
        if skip:
            self.engine.optimizer.zero_grad()
            return {"train/grad_norm": float("nan"), "train/lr": float(lr), "train/skipped_nonfinite": 1.0}
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm if norm is not None else 0.0)
        return {"train/grad_norm": norm, "train/lr": float(lr), "train/skipped_nonfinite": 0.0,
                "train/nonfinite_grad_applied": float(not math.isfinite(norm))}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors one at a time; under ZeRO-3 each is gathered (collective: every rank iterates)."""
        # optional: the [deepspeed] extra
        import deepspeed

        for name, p in self.engine.module.named_parameters():
            if name.startswith("value_head."):
                continue
            if self.zero_stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    yield name, p.data.detach().clone()
            else:
                yield name, p.detach()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("deepspeed checkpoints use DeepSpeed's format: save_native / load_native")

    def save_native(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag="latest")

    def load_native(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag="latest")

