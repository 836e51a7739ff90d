"""The integration layer's built-ins, registered like any plugin: train backends (``single``,
``fsdp2``, ``deepspeed``), launchers (``local``, ``ray``), the benchmark engine ``simulated`` and the
self-play opponent samplers (``mirror``, ``lagged``, ``pool``, ``fixed``). Factories import torch only
when called."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import declare, hookimpl
from tidal.integration.launch import LocalLauncher, RayLauncher
from tidal.integration.sim import SimulatedEngine


def _backend(name: str):
    def make(model: Any, cfg: Any = None, device: str = "cpu", **options: Any) -> Any:
        # heavy: torch, which scanning the plugins must not load
        from tidal.integration.learner import backends

        return getattr(backends, _BACKEND_CLASSES[name])(model, cfg or backends.BackendConfig(), device, **options)

    make.__doc__ = f"The {name} train backend (tidal.integration.learner.backends)."
    return declare(make, signature=f"tidal.integration.learner.backends:{_BACKEND_CLASSES[name]}")


# the one list of train backends: name -> class in tidal.integration.learner.backends
_BACKEND_CLASSES = {"single": "SingleBackend", "fsdp2": "FSDP2Backend", "deepspeed": "DeepSpeedBackend"}


@hookimpl
def tidal_train_backends() -> dict[str, Any]:
    return {name: _backend(name) for name in _BACKEND_CLASSES}


@hookimpl
def tidal_launchers() -> dict[str, Any]:
    @declare(signature="tidal.integration.launch:LocalLauncher")
    def local(**options: Any) -> Any:
        """Every role a local process of the driver (tidal.integration.launch)."""
        return LocalLauncher(**options)

    @declare(signature="tidal.integration.launch:RayLauncher")
    def ray(**options: Any) -> Any:
        """Roles as Ray actors on a Ray cluster (tidal.integration.launch; needs tidal[ray])."""
        return RayLauncher(**options)

    return {"local": local, "ray": ray}


@hookimpl
def tidal_engines() -> dict[str, Any]:
    @declare(signature="tidal.integration.sim:SimulatedEngine")
    def simulated(model: Any = None, **options: Any) -> Any:
        """Sleep-based continuous-batching engine for pipeline benchmarks (tidal.integration.sim)."""
        return SimulatedEngine(model, **options)

    return {"simulated": simulated}


# the one list of opponent samplers: name -> class in tidal.integration.opponents
_OPPONENT_CLASSES = {"mirror": "MirrorSampler", "lagged": "LaggedSampler", "pool": "PoolSampler",
                     "fixed": "FixedSampler"}


def _opponent(name: str):
    def make(**options: Any) -> Any:
        # imported when called, like the backends: scanning plugins does not load openskill
        from tidal.integration import opponents

        return getattr(opponents, _OPPONENT_CLASSES[name])(**options)

    make.__doc__ = f"The {name} opponent sampler of self-play runs (tidal.integration.opponents)."
    # pfsp_weighting shapes only the pfsp rule; the metrics' window changes no pick
    acts_with = {"pfsp_weighting": {"rule": "pfsp"}} if name == "pool" else None
    return declare(make, signature=f"tidal.integration.opponents:{_OPPONENT_CLASSES[name]}", acts_with=acts_with,
                   metric_only=("window",))


@hookimpl
def tidal_opponents() -> dict[str, Any]:
    return {name: _opponent(name) for name in _OPPONENT_CLASSES}
