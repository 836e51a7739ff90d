"""What the buffer refuses at ingest: a decoded trajectory or group it cannot train on, and why."""

from __future__ import annotations

from typing import Any

from tidal.buffer.store import ARRAY_READS
from tidal.core.arrays import ITEMSIZE
from tidal.core.protocol import Trajectory, TrajectoryGroup

_ARRAYS = ("prompt_ids", "completion_ids", "logprobs", "versions", "step_rewards", "step_ends", "loss_mask",
           "routing", "sampling_mask")


def validate(t: Trajectory | Any) -> str | None:
    """Why a decoded trajectory (or `Sample`) cannot be trained on, or None."""
    n = t.completion_ids.shape[0] if len(t.completion_ids.shape) == 1 else -1
    if n < 0 or len(t.prompt_ids.shape) != 1:
        return "prompt_ids and completion_ids must be 1-D"
    shape = (n,)
    if t.logprobs.shape != shape or t.versions.shape != shape:
        name, a = ("logprobs", t.logprobs) if t.logprobs.shape != shape else ("versions", t.versions)
        return f"{name} has shape {a.shape}, completion_ids has ({n},)"
    if t.loss_mask is not None and t.loss_mask.shape != (n,):
        return f"loss_mask has shape {t.loss_mask.shape}, completion_ids has ({n},)"
    if not t.id or not t.group_id:
        return "id and group_id must be non-empty"
    if type(t.versions) in ARRAY_READS:  # a Sample: its arrays' byte counts are checked here (an Array's by itself)
        s: Any = t  # its arrays are ArrayView / ArrayBytes: `data` is the bytes
        p, c, lp, v = s.prompt_ids, s.completion_ids, s.logprobs, s.versions
        size = ITEMSIZE
        if (len(p.data) != size[p.dtype] * p.shape[0] or len(c.data) != size[c.dtype] * n
                or len(lp.data) != size[lp.dtype] * n or len(v.data) != size[v.dtype] * n):
            return _bad_bytes(t, _ARRAYS[:4])
        if (t.step_rewards is not None or t.step_ends is not None or t.loss_mask is not None or t.routing is not None
                or t.sampling_mask is not None):
            return _bad_bytes(t, _ARRAYS[4:])
    return None


def _bad_bytes(t: Any, names: tuple[str, ...]) -> str | None:
    """Which of a Sample's arrays `names` has a byte count its dtype and shape do not fit, or None."""
    for name in names:
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
