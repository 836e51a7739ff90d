"""tidal-staleness' built-ins, registered through the `tidal` entry point: the admission policy
(kind ``admission``, used by the buffer, which has no torch) and the loss corrections (kind
``correction``, used by the learner). No torch at import time. The depth gate is not a plugin: the
controller owns it (tidal.staleness.depth)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tidal.core.plugins import declare, hookimpl

# name -> "module:class" (in tidal.staleness) whose constructor takes the options: one list per kind
ADMISSIONS = {"version_rejection": "rejection:VersionRejection"}
CORRECTIONS = {
    "tis": "correction:TokenTIS", "seq_tis": "correction:SequenceTIS", "masked_is": "correction:MaskedIS",
    "off_policy_seq_mask": "correction:OffPolicySequenceMask", "decoupled_ppo": "correction:DecoupledPPO",
    "icepop": "correction:IcePop", "kv_lag_mask": "correction:KVLagMask",
}


def _make(path: str) -> Callable[..., Any]:
    module, _, cls = path.partition(":")

    def factory(**options: Any) -> Any:
        return getattr(importlib.import_module(f"tidal.staleness.{module}"), cls)(**options)

    factory.__name__ = f"make_{cls}"
    factory.__doc__ = f"tidal.staleness.{module}.{cls}"
    return declare(factory, signature=f"tidal.staleness.{path}")


@hookimpl
def tidal_admissions() -> dict[str, Callable[..., Any]]:
    return {n: _make(p) for n, p in ADMISSIONS.items()}


@hookimpl
def tidal_corrections() -> dict[str, Callable[..., Any]]:
    return {n: _make(p) for n, p in CORRECTIONS.items()}
