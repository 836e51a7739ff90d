"""The two tools. `UnitFactor` can be told to hang (`hang_every`) or to flood (`flood_every`, `flood_mb`):
the n-th call of a process, for n a multiple of the setting, sleeps for ever or returns that many MB."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tidal.core.episodes import ToolResult
from tidal.core.protocol import ToolSpec

FACTORS = {("km", "m"): 1000.0, ("m", "cm"): 100.0, ("kg", "g"): 1000.0, ("h", "min"): 60.0, ("min", "s"): 60.0,
           ("l", "ml"): 1000.0}


class UnitFactor:
    spec = ToolSpec(name="unit_factor", description="How many `to` units make one `from` unit.",
                    parameters={"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}}})

    def __init__(self, hang_every: int = 0, flood_every: int = 0, flood_mb: float = 50.0) -> None:
        self.hang_every, self.flood_every, self.flood_mb = hang_every, flood_every, flood_mb
        self.calls = 0

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        self.calls += 1
        if self.hang_every and self.calls % self.hang_every == 0:
            time.sleep(10_000)  # the author's bug: a lookup that never returns
        if self.flood_every and self.calls % self.flood_every == 0:
            return ToolResult(content="x" * int(self.flood_mb * 1024 * 1024))  # the author's bug: a whole dump
        key = (str(arguments.get("from", "")), str(arguments.get("to", "")))
        if key not in FACTORS:
            return ToolResult(content=f"unknown units {key}", error="bad_arguments")
        return ToolResult(content=f"{FACTORS[key]:g}")


class UnitRound:
    spec = ToolSpec(name="unit_round", description="Round `value` to `digits` decimals.",
                    parameters={"type": "object", "properties": {"value": {"type": "number"},
                                                                 "digits": {"type": "integer"}}})

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        try:
            return ToolResult(content=f"{round(float(arguments['value']), int(arguments.get('digits', 0))):g}")
        except (KeyError, TypeError, ValueError) as e:
            return ToolResult(content=f"bad arguments: {e}", error="bad_arguments")
