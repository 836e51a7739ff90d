"""What the buffer refuses at ingest: a decoded trajectory or group it cannot train on, and why.

`validate` checks structure (shapes, byte counts, ids); `check_values` checks what the numbers say, so that
a forged or broken producer cannot store a NaN reward (which would flow into every advantage of its group),
a token id the model has no embedding for, or versions from the future. Each refusal has a short reason
(counted by the buffer as ``refused/<reason>`` and sent to the producer in its negative Ack).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tidal.buffer.store import ARRAY_READS
from tidal.core.arrays import ITEMSIZE
from tidal.core.protocol import Trajectory, TrajectoryGroup

_ARRAYS = ("prompt_ids", "completion_ids", "logprobs", "versions", "step_rewards", "step_ends", "loss_mask",
           "routing", "sampling_mask", "kv_versions")


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
    kv = t.kv_versions
    if kv is not None and (kv.shape != shape or kv.dtype != "int32"):  # the learner reads it beside versions
        return f"kv_versions has shape {kv.shape} and dtype {kv.dtype}; it must be int32 ({n},) as versions"
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
                or t.sampling_mask is not None or kv is not None):
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


class Refusal(str):
    """Why a message is refused (the text the producer is told), with a short machine-readable `reason`
    (the Ack's `reason`, and the buffer's ``refused/<reason>`` count)."""

    reason: str

    def __new__(cls, text: str, reason: str) -> Refusal:
        self = super().__new__(cls, text)
        self.reason = reason
        return self


# little-endian numpy dtypes of the wire's dtype names (a dict lookup: np.dtype(name) per array costs more)
_NP: dict[str, np.dtype] = {}


def _np(a: Any) -> np.ndarray:
    """The flat numpy view of an Array, ArrayView or ArrayBytes (no copy)."""
    dt = _NP.get(a.dtype)
    if dt is None:
        dt = _NP[a.dtype] = np.dtype(a.dtype).newbyteorder("<")
    data = a.data if type(a) in ARRAY_READS else a.buffer
    return np.frombuffer(data, dtype=dt)


def check_values(t: Trajectory | Any, vocab_size: int, max_version: int | None,
                 max_abs_reward: float) -> tuple[str, str] | None:
    """(reason, detail) when `t`'s values cannot be trained on, or None. Run after `validate` (shapes are
    consistent). `vocab_size` 0 and `max_version` None leave those checks out; `max_abs_reward` 0 too.
    One numpy reduction per array checked: cheap beside the rest of ingest."""
    try:
        return _check_values(t, vocab_size, max_version, max_abs_reward)
    except (TypeError, ValueError) as e:  # a dtype numpy does not know, a byte count that does not fit it
        return "bad_array", f"an array cannot be read: {e}"


def _check_values(t: Any, vocab_size: int, max_version: int | None, max_abs_reward: float) -> tuple[str, str] | None:
    r = t.reward
    if not math.isfinite(r):
        return "nonfinite_reward", f"reward is {r}; rewards must be finite (a broken reward function?)"
    if max_abs_reward and abs(r) > max_abs_reward:
        return "reward_out_of_range", (f"reward {r:g} is beyond ±{max_abs_reward:g} (the buffer's max_abs_reward; "
                                       "raise it if the task's rewards are this large)")
    lp = _np(t.logprobs)
    if lp.dtype.kind != "f":
        return "bad_array", f"logprobs have dtype {t.logprobs.dtype}; they must be float32"
    # a sum is NaN or ±inf when any term is (or when it overflows float64: no real logprobs do)
    if lp.size and not math.isfinite(float(lp.sum(dtype=np.float64))):
        return "nonfinite_logprob", f"logprobs hold {int((~np.isfinite(lp)).sum())} NaN or infinite values"
    if t.step_rewards is not None:
        sr = _np(t.step_rewards)
        if sr.dtype.kind != "f" or (sr.size and not math.isfinite(float(sr.sum(dtype=np.float64)))):
            return "nonfinite_step_reward", "step_rewards hold NaN or infinite values (or are not floats)"
        if t.step_ends is None or t.step_ends.shape != t.step_rewards.shape:
            shape = None if t.step_ends is None else t.step_ends.shape
            return "inconsistent_steps", f"step_ends has shape {shape}, step_rewards has {t.step_rewards.shape}"
        ends = _np(t.step_ends)
        n = t.completion_ids.shape[0]
        if ends.dtype.kind not in "iu" or (ends.size and (int(ends.min()) < 0 or int(ends.max()) > n)):
            return "inconsistent_steps", f"step_ends must be integers in [0, {n}] (the completion's length)"
    if vocab_size > 0:
        for name in ("prompt_ids", "completion_ids"):
            ids = _np(getattr(t, name))
            if ids.dtype.kind not in "iu":
                return "bad_array", f"{name} has dtype {ids.dtype}; token ids must be int32"
            if not ids.size:
                continue
            # as unsigned, a negative id is larger than any vocabulary: one reduction checks both ends
            top = int(ids.view(f"<u{ids.dtype.itemsize}").max())
            if top >= vocab_size:
                bad = ids[(ids < 0) | (ids >= vocab_size)]
                return "token_out_of_range", (f"{name} holds {bad.size} ids outside [0, {vocab_size}) "
                                              f"(first: {int(bad[0])}); the model's vocabulary has {vocab_size}")
    if max_version is not None:
        v = _np(t.versions)
        if v.dtype.kind not in "iu":
            return "bad_array", f"versions have dtype {v.dtype}; they must be int32"
        if v.size and int(v.max()) > max_version:
            return "version_ahead", (f"versions reach {int(v.max())}, newer than the learner's version plus the "
                                     f"buffer's version_slack ({max_version}): weights that do not exist yet")
    return None


def check_all_values(members: Sequence[Any], vocab_size: int, max_version: int | None,
                     max_abs_reward: float) -> tuple[int, str, str] | None:
    """(index, reason, detail) of the first of `members` (trajectories or Samples, a group's or a lone one)
    whose values cannot be trained on, or None. The common case, every member fine, costs one reduction per
    kind of array for all of them together (their bytes joined); only a group that fails it is looked at
    member by member (`check_values`, which says which and why)."""
    try:
        if _all_fine(members, vocab_size, max_version, max_abs_reward):
            return None
    except (TypeError, ValueError):
        pass  # an unexpected layout: the member-by-member checks name it
    for i, t in enumerate(members):
        bad = check_values(t, vocab_size, max_version, max_abs_reward)
        if bad is not None:
            return i, bad[0], bad[1]
    return None


def _raw(a: Any) -> Any:
    return a.data if type(a) in ARRAY_READS else a.buffer


def _all_fine(members: Sequence[Any], vocab_size: int, max_version: int | None, max_abs_reward: float) -> bool:
    """True when every member passes (False may be a false alarm: `check_values` decides)."""
    logprobs: list[Any] = []
    versions: list[Any] = []
    ids: list[Any] = []
    isfinite = math.isfinite
    for t in members:
        r = t.reward
        if not isfinite(r) or (max_abs_reward and abs(r) > max_abs_reward) or t.step_rewards is not None:
            return False
        lp, v = t.logprobs, t.versions
        if lp.dtype != "float32" or v.dtype != "int32":
            return False
        logprobs.append(_raw(lp))
        versions.append(_raw(v))
        if vocab_size > 0:
            p, c = t.prompt_ids, t.completion_ids
            if p.dtype != "int32" or c.dtype != "int32":
                return False
            ids.append(_raw(p))
            ids.append(_raw(c))
    lp_all = np.frombuffer(b"".join(logprobs), "<f4")
    # float32 sum: NaN or inf when any term is (or on overflow, which no real logprobs reach: then the
    # member-by-member float64 check decides)
    if lp_all.size and not isfinite(np.add.reduce(lp_all)):
        return False
    if max_version is not None:
        v_all = np.frombuffer(b"".join(versions), "<i4")
        if v_all.size and int(np.maximum.reduce(v_all)) > max_version:
            return False
    if vocab_size > 0:
        ids_all = np.frombuffer(b"".join(ids), "<u4")  # a negative id is larger than any vocabulary as unsigned
        if ids_all.size and int(np.maximum.reduce(ids_all)) >= vocab_size:
            return False
    return True
