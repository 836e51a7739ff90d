"""What the buffer refuses at ingest: a decoded trajectory or group it cannot train on, and why."""

from __future__ import annotations

from typing import Any

from tidal.buffer.store import ArrayView
from tidal.core.arrays import ITEMSIZE
from tidal.core.protocol import Trajectory, TrajectoryGroup

_ARRAYS = ("prompt_ids", "completion_ids", "logprobs", "versions", "step_rewards", "step_ends", "loss_mask",
           "routing", "sampling_mask")


def validate(t: Trajectory | Any) -> str | None:
    """Why a decoded trajectory (or `Sample`) cannot be trained on, or None."""
    n = t.completion_ids.shape[0] if len(t.completion_ids.shape) == 1 else -1
    if n < 0 or len(t.prompt_ids.shape) != 1:
        return "prompt_ids and completion_ids must be 1-D"
    for name in ("logprobs", "versions"):
        a = getattr(t, name)
        if a.shape != (n,):
            return f"{name} has shape {a.shape}, completion_ids has ({n},)"
    if t.loss_mask is not None and t.loss_mask.shape != (n,):
        return f"loss_mask has shape {t.loss_mask.shape}, completion_ids has ({n},)"
    if not t.id or not t.group_id:
        return "id and group_id must be non-empty"
    if type(t.versions) is ArrayView:  # a Sample: its arrays' byte counts are checked here (an Array's by itself)
        for name in _ARRAYS:
            a = getattr(t, name)
            if a is None:
                continue
            size = ITEMSIZE[a.dtype]
            for d in a.shape:
                size *= d
            if len(a.data) != size:
                return f"{name} has {len(a.data)} bytes; dtype {a.dtype} and shape {a.shape} need {size}"
    return None


def validate_group(g: TrajectoryGroup | Any) -> str | None:
    """Why a decoded group (or `SampleGroup`) cannot be admitted (as a whole), or None."""
    if not g.trajectories:
        return "it has no trajectories"
    seen = set()
    for i, t in enumerate(g.trajectories):
        if t.group_id != g.id:
            return f"trajectories[{i}] ({t.id}) has group_id {t.group_id!r}, not the group's id {g.id!r}"
        if t.id in seen:
            return f"trajectories[{i}] repeats the id {t.id!r}"
        seen.add(t.id)
        why = validate(t)
        if why is not None:
            return f"trajectories[{i}] ({t.id}): {why}"
    return None
