"""The integration layer's built-ins, registered like any plugin: train backends (``single``,
``fsdp2``, ``deepspeed``), launchers (``local``, ``ray``) and the benchmark engine ``simulated``.
Factories import torch only when called."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import hookimpl


def _backend(name: str):
    def make(model: Any, cfg: Any = None, device: str = "cpu", **options: Any) -> Any:
        from tidal.integration.learner.backends import BACKENDS, BackendConfig

        return BACKENDS[name](model, cfg or BackendConfig(), device, **options)

    make.__doc__ = f"The {name} train backend (tidal.integration.learner.backends)."
    return make


@hookimpl
def tidal_train_backends() -> dict[str, Any]:
    return {"single": _backend("single"), "fsdp2": _backend("fsdp2"), "deepspeed": _backend("deepspeed")}


@hookimpl
def tidal_launchers() -> dict[str, Any]:
    def local(**options: Any) -> Any:
        """Every role a local process of the driver (tidal.integration.launch)."""
        from tidal.integration.launch import LocalLauncher

        return LocalLauncher(**options)

    def ray(**options: Any) -> Any:
        """Roles as Ray actors on a Ray cluster (tidal.integration.launch; needs tidal[ray])."""
        from tidal.integration.launch import RayLauncher

        return RayLauncher(**options)

    return {"local": local, "ray": ray}


@hookimpl
def tidal_engines() -> dict[str, Any]:
    def simulated(model: Any = None, **options: Any) -> Any:
        """Sleep-based continuous-batching engine for pipeline benchmarks (tidal.integration.sim)."""
        from tidal.integration.sim import SimulatedEngine

        return SimulatedEngine(model, **options)

    return {"simulated": simulated}
