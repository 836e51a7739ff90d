"""What the buffer refuses at ingest: a decoded trajectory or group it cannot train on, and why."""

from __future__ import annotations

from tidal.core.protocol import Trajectory, TrajectoryGroup


def validate(t: Trajectory) -> str | None:
    """Why a decoded trajectory cannot be trained on, or None."""
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
    return None


def validate_group(g: TrajectoryGroup) -> str | None:
    """Why a decoded group cannot be admitted (as a whole), or None."""
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
