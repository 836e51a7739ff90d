"""The environment pool's processes, one per slot: the slot's state and its episodes' clocks, and
starting, signalling, killing and reaping its process (in a session of its own, so a kill reaches what
it started too). `SlotProcesses` is a base class of `tidal.rollout.episodes.pool.EnvPool`."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.core.process import ERROR_FILE_ENV
from tidal.core.protocol import Message

log = logging.getLogger("tidal.rollout.envpool")

# A stuck process gets SIGUSR1 (its stack to its log), then SIGKILL this much later: the dump takes
# milliseconds, and the pool does not wait for it (other processes' episodes go on meanwhile).
KILL_GRACE_S = 1.0


@dataclass(eq=False)
class _Slot:
    index: int
    name: str
    log_path: Path
    error_path: Path
    proc: subprocess.Popen | None = None
    identity: bytes = b""
    starts: int = 0
    started_at: float = 0.0
    ready: bool = False  # said Hello
    outbox: list[tuple[Message, _Episode | None]] = field(default_factory=list)  # queued until Hello
    episodes: set[str] = field(default_factory=set)
    failures_in_a_row: int = 0  # deaths, timeouts and failed starts with no answer in between
    progress_at: float = 0.0  # when it last answered, or was given work while it had none
    # requests of episodes closed while they were in flight (a dropped group's): the process still serves
    # them, in order, so a stuck one is still the one to blame, not the open queued behind it
    closed_in_flight: list[_Episode] = field(default_factory=list)

    def waiting(self, episodes: dict[str, _Episode]) -> list[_Episode]:
        """Its requests that were sent and are not answered yet (closed episodes' included)."""
        live = [e for e in (episodes[i] for i in self.episodes) if e.pending and e.sent_at != float("inf")]
        return [*self.closed_in_flight, *live]


@dataclass(eq=False)
class _Dying:
    """A process the pool is killing: SIGKILL to its session at `kill_at`, then reaped (by `_service`)."""

    proc: subprocess.Popen
    name: str
    kill_at: float
    killed: bool = False


@dataclass(eq=False)
class _Episode:
    id: str
    slot: _Slot
    seq: int = 0  # the last request sent: 0 = the open
    pending: bool = True  # awaiting the answer to `seq`
    sent_at: float = float("inf")  # when the pending request left (inf while queued for a starting process)


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n    ".join(["", *text]) if text else ""



class SlotProcesses:
    """The pool's handling of its processes (the pool's own state is used as it is)."""

    if TYPE_CHECKING:  # the pool's, which this part uses
        name: str
        environ: dict[str, str]
        _config_path: Path
        _by_identity: dict[bytes, _Slot]
        _dying: list[_Dying]

    def _spawn(self, slot: _Slot) -> None:
        slot.starts += 1
        slot.identity = f"{slot.name}/{slot.starts}".encode()
        slot.ready, slot.started_at = False, time.monotonic()
        self._by_identity[slot.identity] = slot
        slot.error_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "tidal.rollout.episodes.process", "--config", str(self._config_path),
                "--name", slot.name, "--identity", slot.identity.decode()]
        # TIDAL_LOG_DIR: where what an episode starts logs (the `agent` environment's agent processes)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", ERROR_FILE_ENV: str(slot.error_path),
               "TIDAL_LOG_DIR": str(slot.log_path.parent), **self.environ}
        with open(slot.log_path, "ab") as out:  # its own session: a kill reaches what it started too
            slot.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env)

    def _signal(self, slot: _Slot, sig: int) -> None:
        if slot.proc is not None:
            self._signal_group(slot.proc.pid, sig)

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _dump_stack(self, slot: _Slot, why: str) -> None:
        """Have `slot`'s process write every thread's Python stack to its log (faulthandler, registered
        by `setup_role_process`), after a line that says why; the author sees where it was stuck."""
        if slot.proc is None or slot.proc.poll() is not None:
            return
        try:
            with open(slot.log_path, "a") as f:  # O_APPEND, as the process's own output: lines do not interleave
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} tidal.rollout.episodes.pool ERROR {slot.name} (pid "
                        f"{slot.proc.pid}) {why}: its Python stack follows, then it is killed\n")
        except OSError:
            pass  # the stack still goes to the process's own log stream
        try:
            os.kill(slot.proc.pid, signal.SIGUSR1)  # the process alone: its children would die of it
        except ProcessLookupError:
            pass  # gone meanwhile: it is being killed anyway

    def _stop_stuck(self, slot: _Slot, why: str) -> None:
        """Dump `slot`'s stack now and SIGKILL it `KILL_GRACE_S` later (`_reap`): never blocks the caller."""
        if slot.proc is None:
            return
        self._dump_stack(slot, why)
        self._dying.append(_Dying(slot.proc, slot.name, time.monotonic() + KILL_GRACE_S))
        slot.proc = None

    def _reap(self) -> None:
        """SIGKILL the stuck processes whose grace is over, and reap them. A dying process is not polled
        before its SIGKILL: unreaped, its pid (its session's id) cannot be another process's yet."""
        now = time.monotonic()
        for d in list(self._dying):
            if not d.killed:
                if now < d.kill_at:
                    continue
                if d.proc.returncode is None:  # (reaped already: its pid may be another's by now)
                    self._signal_group(d.proc.pid, signal.SIGKILL)
                d.killed, d.kill_at = True, now + 30.0
            if d.proc.poll() is not None:
                self._dying.remove(d)
            elif now > d.kill_at:  # unkillable (uninterruptible I/O): nothing more to do
                log.error("%s: %s (pid %d) survived SIGKILL for 30 s", self.name, d.name, d.proc.pid)
                self._dying.remove(d)

    def _kill(self, slot: _Slot) -> None:
        self._signal(slot, signal.SIGKILL)
        if slot.proc is not None:
            try:
                slot.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # unkillable (uninterruptible I/O): nothing more to do
                log.error("%s: %s (pid %d) survived SIGKILL for 30 s", self.name, slot.name, slot.proc.pid)
