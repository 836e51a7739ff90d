"""Runners (plugin kind ``launcher``): start a run's roles, report the ones that died, restart, stop.

A role is one command: ``python -m MODULE --config ROLE.json [ARGS]``. The run driver
(`tidal.integration.run`) decides what to restart; a launcher only knows how to start, watch and stop.

`local` runs each role as a child process of the driver, each in its own session (Ctrl-C reaches the
driver only, which stops the roles in order) and bound to the driver's life (Linux
PR_SET_PDEATHSIG), so a driver killed with SIGKILL leaves no orphans. Logs go to <run_dir>/logs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger("tidal.launch")


@dataclass
class Role:
    name: str  # unique in the run: "buffer", "learner", "rollout-0", ...
    kind: str  # "buffer" | "learner" | "rollout"
    module: str  # started as python -m MODULE
    config: Path  # the role's JSON config
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    nproc: int = 1  # learner ranks (torch.distributed) for this role

    def argv(self) -> list[str]:
        return ["-m", self.module, "--config", str(self.config), *self.args]


class RunHandle(Protocol):
    def exited(self) -> dict[str, int]: ...  # roles that ended since the last call -> exit code
    def restart(self, name: str) -> None: ...
    def kill(self, name: str) -> None: ...
    def signal(self, name: str, sig: int) -> None: ...
    def running(self, name: str) -> bool: ...
    def stop(self, order: list[str], timeout: float) -> dict[str, int]: ...


PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the driver's finally-block still stops its children


def start_process(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child that dies with its parent, in its own session, logging to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_bind_to_parent if sys.platform.startswith("linux") else None,
                                env={**os.environ, **(env or {})})


class LocalRun:
    def __init__(self, roles: list[Role], run_dir: Path) -> None:
        self.roles = {r.name: r for r in roles}
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        for r in roles:
            self._start(r)

    def _start(self, role: Role) -> None:
        self.starts[role.name] = self.starts.get(role.name, 0) + 1
        args = [*role.argv()] + (["--nproc", str(role.nproc)] if role.nproc > 1 else [])
        p = start_process([sys.executable, *args], self.run_dir / "logs" / f"{role.name}.log", role.env)
        self.procs[role.name] = p
        log.info("started %s (pid %d)%s", role.name, p.pid,
                 f", start {self.starts[role.name]}" if self.starts[role.name] > 1 else "")

    def exited(self) -> dict[str, int]:
        out = {}
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is not None:
                out[name] = rc
                del self.procs[name]
        return out

    def running(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def restart(self, name: str) -> None:
        if self.running(name):
            self.kill(name)
        self._start(self.roles[name])

    def kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    def signal(self, name: str, sig: int) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def stop(self, order: list[str], timeout: float) -> dict[str, int]:
        """SIGTERM each role in `order` (then any left), waiting up to `timeout` for each before SIGKILL
        of its whole process group (learner ranks included)."""
        codes = {}
        for name in [*order, *(n for n in self.procs if n not in order)]:
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                codes[name] = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killed", name, timeout)
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait(timeout=30)
            try:  # anything its children left in the session
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return codes


class LocalLauncher:
    """Every role a local process (plugin ``local``)."""

    def launch(self, roles: list[Role], run_dir: Path) -> LocalRun:
        return LocalRun(roles, run_dir)


def wait_until(pred, timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()
