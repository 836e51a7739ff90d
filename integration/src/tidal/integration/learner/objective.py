"""The train plugins of a recipe (`TrainConfig`), built once for the learner's `Trainer`: the policy
loss, the advantage estimator and the staleness correction, with the pairings they refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.learner.config import TrainConfig


@dataclass(frozen=True, slots=True)
class Objective:
    """The train plugins of a `TrainConfig`, built once: the policy loss, the advantage estimator and the
    staleness correction, and what they say of themselves (tidal.core.interfaces)."""

    loss: Any
    estimator: Any
    correction: Any | None

    @classmethod
    def build(cls, cfg: TrainConfig) -> Objective:
        loss = registry.build("policy_loss", cfg.loss.name, cfg.loss.options, field="train.loss")
        # pairings a loss states of itself (tidal.algos.plugin.LOSS_TRAITS), refused before any model loads
        need = getattr(loss, "requires_advantage", None)
        if need is not None and cfg.advantage.name != need:
            raise ConfigError(f"train.loss.name = {cfg.loss.name!r} needs train.advantage.name = {need!r} (its "
                              f"objective is built on that advantage), got {cfg.advantage.name!r}: set "
                              f"train.advantage.name = {need!r}", field="train.advantage.name")
        refuses = getattr(loss, "refuses_correction", None)
        if refuses and cfg.correction:
            raise ConfigError(f"train.loss.name = {cfg.loss.name!r} takes no staleness correction ({refuses}), got "
                              f"train.correction.name = {cfg.correction.name!r}: remove train.correction",
                              field="train.correction")
        return cls(
            loss=loss,
            estimator=registry.build("advantage_estimator", cfg.advantage.name, cfg.advantage.options,
                                     field="train.advantage"),
            correction=registry.build("correction", cfg.correction.name, cfg.correction.options,
                                      field="train.correction") if cfg.correction else None)

    @property
    def reads_reference(self) -> bool:
        """The loss reads reference logprobs (a KL penalty to it, or distillation from it)."""
        return bool(getattr(self.loss, "reads_reference", False))

    @property
    def needs_values(self) -> bool:
        """The advantage estimator reads a critic's values (GAE: PPO mode)."""
        return bool(getattr(self.estimator, "needs_values", False))
