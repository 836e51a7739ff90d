"""What the learner refuses before its model loads, importable without torch: the driver runs the same
checks before any role starts (`tidal run` and `--check` stay fast: no torch in the driver). The
`learner.parallel` checks live with their subject in parallel.py, which is torch-free at import too."""

from __future__ import annotations

from tidal.core.errors import ConfigError
from tidal.learner.config import LearnerConfig, ParallelConfig


def check_lora(cfg: LearnerConfig, world: int) -> None:
    """Refuse `learner.lora` where this learner cannot train adapters yet (before the model loads)."""
    if cfg.lora is None:
        return
    why = []
    if cfg.backend.name != "single":
        why.append(f"the {cfg.backend.name!r} backend shards parameters, and its adapters are not wired to "
                   f"PEFT here (use learner.backend.name = \"single\")")
    if world > 1:
        why.append(f"{world} learner ranks: the adapters are trained by one rank for now (--nproc 1)")
    if cfg.parallel != ParallelConfig():
        why.append("sequence or expert parallelism (learner.parallel) splits the model over ranks")
    if why:
        raise ConfigError("learner.lora cannot be used here: " + "; ".join(why) + ". Unset learner.lora for full "
                          "fine-tuning, or change the layout.", field="learner.lora")
