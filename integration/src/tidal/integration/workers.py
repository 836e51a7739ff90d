"""What the controller knows of each rollout worker it hands work to."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tidal.core.protocol import Assignment


@dataclass
class WorkerState:
    name: str
    peer: bytes
    credits: int = 0
    version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    outstanding: dict[str, Assignment] = field(default_factory=dict)  # group id -> assignment
    alive: bool = True
    applied_at: float = 0.0  # wall clock at which it applied the weights of `version` (its report)
