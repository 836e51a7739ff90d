"""tidal.staleness: what makes asynchrony safe. Version accounting, version rejection and the depth
gate are pure Python/numpy (the buffer and controller use them without torch); the importance-sampling
corrections and metrics use torch. Names are imported lazily so the pure parts never pull torch in.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "LagStats": "versions",
    "lag_stats": "versions",
    "token_lags": "versions",
    "VersionRejection": "rejection",
    "DepthGate": "depth",
    "GateState": "depth",
    "CorrectionInputs": "correction",
    "Correction": "correction",
    "TokenTIS": "correction",
    "SequenceTIS": "correction",
    "MaskedIS": "correction",
    "OffPolicySequenceMask": "correction",
    "DecoupledPPO": "correction",
    "combine": "correction",
    "mismatch_kl": "metrics",
    "effective_sample_size": "metrics",
    "sequence_lags": "metrics",
    "step_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.staleness' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.staleness.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
