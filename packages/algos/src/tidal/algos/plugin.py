"""tidal-algos' built-ins, registered through the `tidal` entry point like any third-party plugin.

This module imports no torch at import time: the buffer (no torch) loads it to find group filters.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from tidal.algos.filters import LengthFilter, ZeroVarianceFilter
from tidal.core.plugin_options import NONZERO, NoOptions
from tidal.core.plugins import declare, hookimpl

# what a loss function may say of itself, copied onto the built loss for the learner to read: the
# aggregation it reduces by when it takes no `agg`, the advantage it needs, why it takes no correction
LOSS_TRAITS = ("aggregation", "requires_advantage", "refuses_correction")


def _loss_factory(qualified: str, metric_only: tuple[str, ...] = ()) -> Callable[..., Callable[[Any], Any]]:
    # "name" is a function of tidal.algos.losses, "module:name" one of tidal.algos.<module>
    module, _, name = qualified.rpartition(":")
    module = module or "losses"

    def make(**options: Any) -> Callable[[Any], Any]:
        # imported here, not at the top: the loss modules load torch, which the buffer loading this module
        # must not pay for
        fn = getattr(importlib.import_module(f"tidal.algos.{module}"), name)
        params = inspect.signature(fn).parameters
        unknown = sorted(set(options) - set(params) - {"inputs"})
        if unknown:
            allowed = ", ".join(p for p in params if p != "inputs")
            raise TypeError(f"{name} has no option(s) {', '.join(unknown)}; options are: {allowed}")
        loss = functools.partial(fn, **options)
        # what the learner asks: whether to load a frozen reference model for this loss
        loss.reads_reference = bool(getattr(fn, "reads_reference", False) or options.get("kl_coef"))  # type: ignore[attr-defined]  # a partial takes attributes; its stub declares none
        for trait in LOSS_TRAITS:
            if hasattr(fn, trait):
                setattr(loss, trait, getattr(fn, trait))
        return loss

    make.__doc__ = f"Build tidal.algos.{module}.{name} with fixed options."
    return declare(make, signature=f"tidal.algos.{module}:{name}", skip=("inputs",), acts_with=LOSS_ACTS_WITH,
                   metric_only=metric_only)


# where a loss option changes nothing, so that a recipe setting it there is refused (not ignored)
LOSS_ACTS_WITH = {
    "norm_length": {"agg": "seq-mean-token-sum-norm"},  # the only aggregation that divides by a length
    "kl_estimator": {"kl_coef": NONZERO},  # estimates the KL term, which kl_coef = 0 leaves out
}


# estimator name -> (class in tidal.algos.estimators, whether the class takes the name as its `kind`)
ESTIMATORS: dict[str, tuple[str, bool]] = {
    "grpo": ("GroupEstimator", True), "dr_grpo": ("GroupEstimator", True), "rloo": ("GroupEstimator", True),
    "opo": ("GroupEstimator", True), "reinforce_pp": ("ReinforcePPEstimator", False), "gae": ("GAEEstimator", False),
    "grpo_process": ("ProcessEstimator", False), "oapl": ("OAPLEstimator", False),
    "gpg": ("GPGEstimator", False), "passk": ("PassKEstimator", False), "remax": ("ReMaxEstimator", False),
    "rae": ("RoleBaselineEstimator", False),
}

# estimators whose groups carry a greedy member as their baseline (ReMax): read without torch by the
# controller (it asks the rollout for that member) and the recipe check
GREEDY_BASELINE = ("remax",)


# group estimators whose baseline has no options (GroupEstimator's eps and unbiased_std are GRPO's std's)
NO_OPTIONS = ("dr_grpo", "rloo", "opo")


def _estimator_factory(name: str) -> Callable[..., Any]:
    cls_name, takes_kind = ESTIMATORS[name]

    def make(**options: Any) -> Any:
        from tidal.algos import estimators  # heavy: torch (see the module docstring)

        cls = getattr(estimators, cls_name)
        return cls(name, **options) if takes_kind else cls(**options)

    make.__doc__ = f"tidal.algos.estimators.{cls_name}" + (f"({name!r})" if takes_kind else "")
    if name in NO_OPTIONS:
        return declare(make, options=NoOptions)
    return declare(make, signature=f"tidal.algos.estimators:{cls_name}", skip=("kind",))


@hookimpl
def tidal_policy_losses() -> dict[str, Callable[..., Any]]:
    return {
        "ppo": _loss_factory("ppo_loss"),
        "gspo": _loss_factory("gspo_loss", metric_only=("clip_frac",)),  # which clip fraction is logged
        "cispo": _loss_factory("cispo_loss"),
        "reinforce": _loss_factory("reinforce_loss"),
        "distillation": _loss_factory("distillation_loss"),
        "value": _loss_factory("value_loss"),
        "oapl": _loss_factory("offpolicy:oapl_loss"),
        "m2po": _loss_factory("offpolicy:m2po_loss"),
        "topr": _loss_factory("offpolicy:topr_loss"),
        "sapo": _loss_factory("sapo_loss"),
        "gmpo": _loss_factory("gmpo_loss"),
        "dppo": _loss_factory("dppo_loss"),
        "kl_cov": _loss_factory("kl_cov_loss"),
    }


@hookimpl
def tidal_advantage_estimators() -> dict[str, Callable[..., Any]]:
    return {k: _estimator_factory(k) for k in ESTIMATORS}


@hookimpl
def tidal_group_filters() -> dict[str, Callable[..., Any]]:
    return {"zero_variance": ZeroVarianceFilter, "length": LengthFilter}
