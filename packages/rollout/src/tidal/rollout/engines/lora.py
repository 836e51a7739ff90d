"""LoRA adapter payloads on the generator side.

A learner training LoRA adapters (`learner.lora`) sends them alone (`WeightsAvailable.lora_only`), under the
names PEFT saves them with: `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r], and announces their scale (`lora_scale` = alpha / r). The layer the generator runs is
`W + lora_scale * B @ A`, W being the base weight it started from.

- `AdapterMerger` (the embedded engine): keeps a copy of each adapted layer's base weight the first time an
  adapter reaches it, and turns every payload into merged weights from that base (versions replace each
  other, they never accumulate).
- `write_adapter` (vLLM): the payload as a PEFT adapter folder (`adapter_config.json`,
  `adapter_model.safetensors`), which vLLM's LoRA support loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from tidal.core.interfaces import NamedTensors

# PEFT's saved names; the adapter's own name (".default") is tolerated, as a live model's state dict has it
ADAPTER_NAME = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight")


class AdapterError(ValueError):
    """A LoRA payload that does not fit the model (names, shapes, a missing half, no scale)."""


def adapter_pairs(weights: NamedTensors) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]) of a LoRA payload; raises AdapterError on another name or a
    module with only one half."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    other = []
    for name, t in weights:
        m = ADAPTER_NAME.fullmatch(name)
        if m is None:
            other.append(name)
            continue
        halves.setdefault(m["module"], {})[m["part"]] = t
    if other:
        raise AdapterError(f"a LoRA payload holds tensors that are not adapters: {other[:3]} (expected PEFT's "
                           f"names, <module>.lora_A.weight and <module>.lora_B.weight)")
    half = sorted(k for k, v in halves.items() if len(v) != 2)
    if half:
        raise AdapterError(f"LoRA adapters of {half[:3]} came with only one of lora_A / lora_B")
    return {k: (v["A"], v["B"]) for k, v in halves.items()}


class AdapterMerger:
    """Turns LoRA payloads into the merged weights of a model's adapted Linear layers."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params  # the model's parameters by name (the engine's live ones)
        self.base: dict[str, torch.Tensor] = {}  # "<module>.weight" -> the base weight, copied once

    def merged(self, weights: NamedTensors, scale: float) -> list[tuple[str, torch.Tensor]]:
        """(weight name, W + scale * B @ A) for every adapted layer of `weights`."""
        if not scale > 0:
            raise AdapterError("LoRA adapters were announced without their scale (lora_scale = alpha / rank): "
                               "a sender of an older release; upgrade tidal-weight-sync on the trainer")
        out = []
        for module, (a, b) in adapter_pairs(weights).items():
            name = f"{module}.weight"
            w = self.params.get(name)
            if w is None:
                raise AdapterError(f"a LoRA adapter for {module!r}, which this model does not have (a "
                                   f"Linear layer's weight {name!r})")
            if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                raise AdapterError(f"the LoRA adapter of {module!r} (A {tuple(a.shape)}, B {tuple(b.shape)}) does "
                                   f"not fit its weight {tuple(w.shape)}")
            base = self.base.get(name)
            if base is None:
                base = self.base[name] = w.detach().clone()
            with torch.no_grad():
                delta = (b.to(device=base.device, dtype=torch.float32) @ a.to(device=base.device, dtype=torch.float32))
                out.append((name, base + (delta * scale).to(base.dtype)))
        return out

    def forget(self) -> None:
        """A dense update replaced the base weights: later adapters merge into those."""
        self.base.clear()


def write_adapter(folder: str | Path, weights: NamedTensors, scale: float) -> Path:
    """A LoRA payload as a PEFT adapter folder at `folder` (what vLLM's `LoRARequest` loads): the tensors
    under PEFT's names, and a config whose `lora_alpha / r` is `scale`."""
    # heavy: safetensors' torch writer, only with vLLM
    from safetensors.torch import save_file

    pairs = adapter_pairs(weights)
    if not scale > 0:
        raise AdapterError("LoRA adapters were announced without their scale (lora_scale = alpha / rank)")
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise AdapterError(f"LoRA adapters of several ranks {sorted(ranks)} in one payload")
    rank = ranks.pop()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous().clone()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous().clone()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[-1] for m in pairs})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder
