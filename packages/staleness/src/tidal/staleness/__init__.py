"""tidal.staleness: what makes asynchrony safe. Version accounting, version rejection and the depth
gate are pure Python/numpy (the buffer and controller use them without torch); the importance-sampling
corrections and metrics use torch. Names are imported lazily so the pure parts never pull torch in.
"""

from __future__ import annotations

from tidal.core.lazy import lazy_exports

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
    "IcePop": "correction",
    "KVLagMask": "correction",
    "OffPolicySequenceMask": "correction",
    "DecoupledPPO": "correction",
    "combine": "correction",
    "mismatch_kl": "metrics",
    "effective_sample_size": "metrics",
    "sequence_lags": "metrics",
    "step_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
