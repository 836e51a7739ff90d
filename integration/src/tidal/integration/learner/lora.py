"""LoRA on the learner's policy (`learner.lora`), through PEFT.

`add_lora` wraps the loaded causal LM in PEFT's LoRA: the base weights are frozen, adapters
(`lora_A` [r, in], `lora_B` [out, r], B starting at zero) are added to the named Linear layers, and
`W + (alpha / r) * B @ A` is the layer's weight. What the rest of the learner sees:

- the optimizer is built over the parameters that require a gradient: the adapters (and a PPO critic's
  value head), so its state is the adapters' size;
- `adapter_weights` is what generators are sent: the adapter tensors under the names PEFT saves them with
  (`base_model.model.<module>.lora_A.weight`), so a received payload is also a PEFT adapter file's
  contents (vLLM loads that);
- `merged_weights` is the full model with the adapters merged, under the base model's own names (the
  export, `tidal export`);
- checkpoints hold the trainable parameters only (`checkpoint_options`): the frozen base is the model
  folder, reloaded on resume.

`check_lora` (learner/checks.py, torch-free: the driver runs it too) refuses what cannot train adapters
yet, before the model loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from tidal.core.errors import ConfigError
from tidal.learner.config import LoraOptions

ADAPTER = "default"  # PEFT's name for the one adapter


def add_lora(module: torch.nn.Module, opts: LoraOptions) -> torch.nn.Module:
    """`module` (a transformers causal LM) with LoRA adapters on `opts.target_modules`, only they (and a
    value head, when there is one) trainable. Raises ConfigError when a target is not a Linear layer or
    names no module."""
    # heavy: peft (imports transformers' pieces); only a LoRA learner needs it
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in module.named_modules()}
    missing = [t for t in opts.target_modules if t not in names]
    if missing:
        raise ConfigError(f"learner.lora.target_modules names {missing}, which this model does not have; its "
                          f"Linear layers are named {sorted(_linear_names(module))}", field="learner.lora.target_modules")
    not_linear = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                         if n.rsplit(".", 1)[-1] in opts.target_modules and not isinstance(m, torch.nn.Linear)})
    if not_linear:
        raise ConfigError(f"learner.lora.target_modules {not_linear} are not Linear layers: the generators "
                          f"merge adapters into Linear weights only; choose among {sorted(_linear_names(module))}",
                          field="learner.lora.target_modules")
    # lora_alpha is annotated int in PEFT, which computes the scale as lora_alpha / r in float: 2.5 stays 2.5
    config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha, lora_dropout=opts.dropout,  # type: ignore[arg-type]
                        target_modules=list(opts.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(module, config)
    head = getattr(module, "value_head", None)
    if head is not None:  # the critic trains beside the adapters (it is never sent)
        head.requires_grad_(True)
    return model


def _linear_names(module: torch.nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters as PEFT saves them (`base_model.model.<module>.lora_A.weight`, the adapter's name left
    out): what generators are sent, and what `adapter_model.safetensors` holds."""
    # heavy: peft, as above
    from peft import get_peft_model_state_dict

    for name, t in get_peft_model_state_dict(model, adapter_name=ADAPTER).items():
        yield name, t.detach()


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full policy with the adapters merged (W + scale * B @ A), under the base model's names; the
    training model is left as it is (merged copies are made one layer at a time)."""
    # heavy: peft, as above
    from peft.tuners.lora import Linear as LoraLinear

    base = model.get_base_model()  # type: ignore[operator]
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLinear)}  # only Linear targets
    for name, t in base.state_dict().items():
        if "lora_" in name or name.startswith("value_head."):
            continue
        prefix, _, leaf = name.rpartition(".base_layer.")
        if prefix in layers and leaf == "weight":
            with torch.no_grad():
                yield f"{prefix}.weight", t.detach() + layers[prefix].get_delta_weight(ADAPTER).to(t.dtype)
        else:
            yield name.replace(".base_layer.", "."), t.detach()


# torch.distributed.checkpoint's state-dict options that keep only the trainable parameters; loading them
# leaves the frozen base as it is (not strict: the backend checks the names itself, and refuses others)
CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
