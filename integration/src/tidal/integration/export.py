"""`tidal export`: a run's kept checkpoint as a Hugging Face folder, offline (no role running).

    export_run("runs/arith-20261204-101500", "latest")          # -> <run>/model-latest
    export_run("runs/arith-20261204-101500", "best", "/models/arith-best")

The run folder says where its checkpoints are and which model the learner started from (its config,
tokenizer and generation config are copied): `roles/learner.json`. A learner that stops cleanly writes
`<run>/model` itself (`learner.export_dir`); this is for any other checkpoint, or a run that crashed.
LoRA (`learner.lora`): a checkpoint holds the adapters alone; they are merged into the starting model's
weights (W + alpha / rank * B @ A), so the folder is a whole model, as the learner's own export is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from tidal.integration.monitor import read_metrics
from tidal.integration.report import summarize
from tidal.learner.config import LearnerConfig


def learner_config(run_dir: str | Path) -> LearnerConfig:
    path = Path(run_dir) / "roles" / "learner.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a tidal run folder (written by `tidal run`)?")
    return msgspec.json.decode(path.read_bytes(), type=LearnerConfig)


def kept_checkpoints(checkpoint_dir: Path) -> dict[str, Path]:
    """Complete checkpoints by name: "latest" and, with learner.keep_checkpoints > 1, "step-000010", ..."""
    found = {p.name: p for p in sorted(checkpoint_dir.glob("step-*")) if (p / "progress.json").is_file()}
    if (checkpoint_dir / "latest" / "progress.json").is_file():
        found["latest"] = checkpoint_dir / "latest"
    return found


def _version(path: Path) -> int:
    return int(json.loads((path / "progress.json").read_text())["version"])


def find_checkpoint(run_dir: str | Path, which: str = "latest") -> Path:
    """The checkpoint folder `which` names: "latest", a step number (kept as step-<N>: see
    learner.keep_checkpoints) or "best" (`checkpoints/best`, which the driver pins, or else the kept checkpoint
    whose policy version scored the highest held-out accuracy in the run's evaluations)."""
    cfg = learner_config(run_dir)
    root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(run_dir) / "checkpoints"
    kept = kept_checkpoints(root)
    names = ", ".join(kept) or "none"
    if not kept:
        raise FileNotFoundError(f"no complete checkpoint under {root}: the learner wrote none (checkpoint_every, "
                                f"or the run ended before its first)")
    if which == "latest":
        if "latest" not in kept:
            raise FileNotFoundError(f"no complete checkpoint at {root / 'latest'}; kept: {names}")
        return kept["latest"]
    if which == "best":
        if (root / "best" / "progress.json").is_file():  # pinned by the driver: the best evaluated checkpointed one
            return root / "best"

        accuracy = {e["version"]: e["accuracy"] for e in summarize(read_metrics(run_dir))["eval"]}
        scored = [(accuracy[_version(p)], _version(p), p) for p in kept.values() if _version(p) in accuracy]
        if not scored:
            raise ValueError(f"no kept checkpoint of {run_dir} was evaluated (kept: "
                             f"{', '.join(f'{n} = version {_version(p)}' for n, p in kept.items())}; evaluated "
                             f"versions: {sorted(accuracy) or 'none'}): pass --checkpoint latest or a step, or keep "
                             f"more (learner.keep_checkpoints) at versions eval.every divides")
        return max(scored, key=lambda s: (s[0], s[1]))[2]
    if not which.isdigit():
        raise ValueError(f"--checkpoint {which!r}: give latest, best or a step number (kept: {names})")
    path = root / f"step-{int(which):06d}"
    if path.name not in kept:
        if "latest" in kept and _version(kept["latest"]) == int(which):
            return kept["latest"]
        raise FileNotFoundError(f"no checkpoint of step {which} is kept under {root} (kept: {names}); "
                                f"learner.keep_checkpoints = N keeps the newest N")
    return path


def export_run(run_dir: str | Path, which: str = "latest", out: str | Path | None = None) -> Path:
    """Write checkpoint `which` of the run as a Hugging Face folder (default <run>/model-<checkpoint>)."""
    # heavy: torch; reading a run's metrics needs none
    from tidal.learner.checkpoint import checkpoint_weights, write_hf

    cfg = learner_config(run_dir)
    ckpt = find_checkpoint(run_dir, which)
    out = Path(out) if out else Path(run_dir) / f"model-{ckpt.name}"
    weights = checkpoint_weights(ckpt, cfg.model)
    if cfg.lora is not None:
        weights = merged_into_base(weights, cfg.model, cfg.lora.scale)
    return write_hf(out, weights, cfg.model)


def merged_into_base(adapters: dict[str, Any], model: str | Path, scale: float) -> dict[str, Any]:
    """A LoRA checkpoint's adapters merged into the weights of `model` (the folder the run started from)."""
    # heavy: torch and safetensors, as above
    from safetensors.torch import load_file

    from tidal.rollout.engines.lora import AdapterMerger

    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"the run trained LoRA adapters on {model}, whose weights (*.safetensors) are "
                                f"needed to merge them and are not there")
    base = {k: v for f in files for k, v in load_file(str(f)).items()}
    lora = [(n, t) for n, t in adapters.items() if "lora_" in n]
    if not lora:
        raise ValueError("the run's learner.lora is set but its checkpoint holds no adapter (lora_A / lora_B) tensors")
    base.update(AdapterMerger(base).merged(lora, scale))
    return base
