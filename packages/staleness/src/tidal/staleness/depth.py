"""Depth bound (`max_staleness`): a gate the controller asks before handing out new prompts.

    capacity = (max_staleness + version + 1) * batch_size - (accepted + in_flight)

in the manner of AReaL's staleness manager. `version` is the policy version new generation is
guaranteed to use (the oldest version any rollout worker holds); `accepted` counts samples that reached
the buffer (consumed ones included); `in_flight` counts samples granted and not yet accepted or rejected.
If samples are trained in the order they were granted, none is ever more than `max_staleness` versions
old when trained on. Out-of-order completion lets a straggler age beyond that: the gate keeps such
stragglers rare, and `VersionRejection(max_lag=max_staleness)` at serving time makes it impossible.

The counters are persisted on every change and reloaded on construction, so a restarted controller keeps
the bound. Restarting from zeroed counters with the learner's version restored would grant a whole window
of samples at once and break it (AReaL#1388). The file is a journal: each change appends the whole state
as one JSON line in one write() to a file kept open (a few microseconds; the controller changes it twice
per group), and every `COMPACT_EVERY` lines it is rewritten to its last line (atomic replace). On load the
last line wins; a last line cut short by a crash mid-write is skipped for the one before it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec

from tidal.staleness.config import DepthGateConfig

COMPACT_EVERY = 4096  # journal lines before the file is rewritten to one


class GateState(msgspec.Struct, kw_only=True):
    version: int = 0  # policy version generation is guaranteed to use
    accepted: int = 0  # samples accepted into the buffer so far (including consumed ones)
    in_flight: int = 0  # samples granted to generators, not yet accepted or rejected
    granted: int = 0  # samples ever granted (diagnostics)
    rejected: int = 0  # samples ever rejected or lost (diagnostics)


class DepthGate:
    """Thread-safe; one per run, owned by the controller."""

    def __init__(
        self, max_staleness: int, batch_size: int, state_path: str | os.PathLike[str] | None = None, fsync: bool = False
    ) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise ValueError(f"need max_staleness >= 0 and batch_size >= 1, got {max_staleness}, {batch_size}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.state_path = Path(state_path) if state_path else None
        self.fsync = fsync
        self._lock = threading.Lock()
        self._state = GateState()
        self._fd: int | None = None  # the journal, open for appending
        self._lines = 0  # lines in it
        if self.state_path is not None and self.state_path.exists():
            self._state = _load(self.state_path)

    @classmethod
    def from_config(cls, cfg: DepthGateConfig) -> DepthGate:
        return cls(cfg.max_staleness, cfg.batch_size, cfg.state_path or None, cfg.fsync)

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> GateState:
        with self._lock:
            return msgspec.structs.replace(self._state)

    def capacity(self) -> int:
        with self._lock:
            return self._capacity()

    def _capacity(self) -> int:
        s = self._state
        return (self.max_staleness + s.version + 1) * self.batch_size - (s.accepted + s.in_flight)

    # ------------------------------------------------------------------ transitions (each persisted)

    def try_acquire(self, n: int = 1) -> bool:
        """Grant `n` samples (e.g. one group) all or nothing. The grant is on disk before this returns."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        with self._lock:
            if self._capacity() < n:
                return False
            self._state.in_flight += n
            self._state.granted += n
            self._save()
            return True

    def accept(self, n: int = 1) -> None:
        """`n` granted samples reached the buffer."""
        with self._lock:
            self._resolve(n)
            self._state.accepted += n
            self._save()

    def reject(self, n: int = 1) -> None:
        """`n` granted samples will never reach the buffer (filtered, failed, lost): capacity returns."""
        with self._lock:
            self._resolve(n)
            self._state.rejected += n
            self._save()

    def set_version(self, version: int) -> None:
        """The version new generation is guaranteed to use moved forward."""
        with self._lock:
            if version < self._state.version:
                raise ValueError(
                    f"version went back from {self._state.version} to {version}; after a learner rollback "
                    "restore the gate with load_state_dict() from the same checkpoint"
                )
            self._state.version = version
            self._save()

    def _resolve(self, n: int) -> None:
        if n < 1 or n > self._state.in_flight:
            raise ValueError(f"cannot resolve {n} samples: only {self._state.in_flight} are in flight")
        self._state.in_flight -= n

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, int]:
        with self._lock:
            return msgspec.structs.asdict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._lock:
            self._state = msgspec.convert(state, GateState)
            self._save()

    def _save(self) -> None:
        if self.state_path is None:
            return
        line = msgspec.json.encode(self._state) + b"\n"
        if self._fd is None or self._lines >= COMPACT_EVERY:
            self._rewrite(line)
            return
        os.write(self._fd, line)  # one write of < 200 bytes to an O_APPEND file: whole or not at all
        if self.fsync:
            os.fsync(self._fd)
        self._lines += 1

    def _rewrite(self, line: bytes) -> None:
        """The journal replaced by a file holding `line` only (atomic), then kept open for appending."""
        assert self.state_path is not None
        self._close_fd()
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(line)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.state_path)
        self._fd = os.open(self.state_path, os.O_WRONLY | os.O_APPEND)
        self._lines = 1

    def close(self) -> None:
        """Close the journal (the state stays on disk; a later change reopens it)."""
        with self._lock:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None  # (also from __del__ of a half-built gate)
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self._close_fd()

    def __repr__(self) -> str:
        s = self._state
        return (f"DepthGate(max_staleness={self.max_staleness}, batch_size={self.batch_size}, version={s.version}, "
                f"accepted={s.accepted}, in_flight={s.in_flight}, capacity={self._capacity()})")


def _load(path: Path) -> GateState:
    """The last state in the journal at `path` (a file written before journaling holds one state, with no
    newline). A last line that does not decode was cut short by a crash: the line before it counts."""
    lines = path.read_bytes().split(b"\n")
    error: Exception | None = None
    for i in (len(lines) - 1, len(lines) - 2):  # the unterminated end (normally empty), then the last line
        if i < 0 or not lines[i].strip():
            continue
        try:
            return msgspec.json.decode(lines[i], type=GateState)
        except msgspec.MsgspecError as e:
            error = error or e
            if i < len(lines) - 1:
                break  # a newline-terminated line that does not decode: corruption, not a cut
    raise RuntimeError(
        f"depth gate state {path} is unreadable ({error or 'empty file'}); refusing to start with zeroed "
        "counters, which would break the staleness bound. Restore it from the last checkpoint "
        "(DepthGate.load_state_dict) or delete it to start a fresh run."
    )
