"""tidal-algos' built-ins, registered through the `tidal` entry point like any third-party plugin.

This module imports no torch at import time: the buffer (no torch) loads it to find group filters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from tidal.core.plugins import hookimpl


def _loss_factory(name: str) -> Callable[..., Callable[[Any], Any]]:
    def make(**options: Any) -> Callable[[Any], Any]:
        from tidal.algos import losses

        fn = getattr(losses, name)
        params = inspect.signature(fn).parameters
        unknown = sorted(set(options) - set(params) - {"inputs"})
        if unknown:
            allowed = ", ".join(p for p in params if p != "inputs")
            raise TypeError(f"{name} has no option(s) {', '.join(unknown)}; options are: {allowed}")
        return functools.partial(fn, **options)

    make.__doc__ = f"Build tidal.algos.losses.{name} with fixed options."
    return make


def _estimator_factory(kind: str) -> Callable[..., Any]:
    def make(**options: Any) -> Any:
        from tidal.algos import estimators

        if kind in ("grpo", "dr_grpo", "rloo", "opo"):
            return estimators.GroupEstimator(kind, **options)
        if kind == "reinforce_pp":
            return estimators.ReinforcePPEstimator(**options)
        return estimators.GAEEstimator(**options)

    return make


@hookimpl
def tidal_policy_losses() -> dict[str, Callable[..., Any]]:
    return {
        "ppo": _loss_factory("ppo_loss"),
        "gspo": _loss_factory("gspo_loss"),
        "cispo": _loss_factory("cispo_loss"),
        "reinforce": _loss_factory("reinforce_loss"),
        "distillation": _loss_factory("distillation_loss"),
        "value": _loss_factory("value_loss"),
    }


@hookimpl
def tidal_advantage_estimators() -> dict[str, Callable[..., Any]]:
    return {k: _estimator_factory(k) for k in ("grpo", "dr_grpo", "rloo", "opo", "reinforce_pp", "gae")}


@hookimpl
def tidal_group_filters() -> dict[str, Callable[..., Any]]:
    from tidal.algos.filters import LengthFilter, ZeroVarianceFilter

    return {"zero_variance": ZeroVarianceFilter, "length": LengthFilter}
