"""The `tidal` entry point: the environment ``unitconv`` and its tools ``unit_factor`` and ``unit_round``.
Imports nothing heavy: every Tidal process scans plugins."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import hookimpl


def unitconv(**options: Any) -> Any:
    """Convert a quantity between units in a few turns; looks units up with the `unit_factor` tool."""
    if options.pop("backend", "table") == "pint":  # the lazy import an author gets wrong: pint is not installed
        from unitconv_tidal.pint_backend import PintUnits  # noqa: F401

    from unitconv_tidal.env import UnitConv

    return UnitConv(**options)


def unit_factor(**options: Any) -> Any:
    """The factor from one unit to another (a tool)."""
    from unitconv_tidal.tools import UnitFactor

    return UnitFactor(**options)


def unit_round(**options: Any) -> Any:
    """Round a number to some digits (a tool)."""
    from unitconv_tidal.tools import UnitRound

    return UnitRound(**options)


@hookimpl
def tidal_envs() -> dict[str, Any]:
    return {"unitconv": unitconv}


@hookimpl
def tidal_tools() -> dict[str, Any]:
    return {"unit_factor": unit_factor, "unit_round": unit_round}
