"""Limits on a whole call (every process it starts, together): a cgroup of its own, when this machine
lets us make one.

`probe()` finds a cgroup v2 hierarchy whose controllers we may use, or else the cgroup v1 hierarchies of
the pids, memory, cpu and cpuacct controllers, and proves it by making and removing a group; None when
neither works (no permission, a read-only /sys/fs/cgroup, controllers not delegated). `CallGroup` is one
call's group: a process count (pids.max), a memory total without swap, at most one CPU's worth of time,
and the CPU seconds used so far, for the caller to enforce a total. The sandbox enters it between fork and
exec (`enter`); `close` kills whatever is still in it and removes it.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

V1_CONTROLLERS = ("pids", "memory", "cpu", "cpuacct")
V2_CONTROLLERS = ("pids", "memory", "cpu")
_names = itertools.count()


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's groups go: "v2" with one parent folder, or "v1" with one per controller."""

    version: str
    parents: dict[str, str]  # controller -> the folder new groups are made in (v2: the same for all)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(fs type, mount point, options) of each cgroup mount."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype, options, *_ = line.split()
            if fstype in ("cgroup", "cgroup2"):
                found.append((fstype, point, set(options.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """controller -> this process's group path in its hierarchy ("" is v2's key)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _parent(point: str, own: str) -> str:
    """The folder of our own group under `point` when it is visible there; else the mount's root (a
    container sees its own group as a path its mount does not show)."""
    folder = os.path.join(point, own.lstrip("/"))
    return folder if os.path.isdir(folder) else point


def _hierarchies() -> list[Hierarchy]:
    mounts, own = _mounts(), _own_paths()
    found = []
    for fstype, point, _ in mounts:
        if fstype != "cgroup2" or not os.path.exists(os.path.join(point, "cgroup.controllers")):
            continue
        parent = _parent(point, own.get("", "/"))
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if set(V2_CONTROLLERS) <= set(f.read().split()):
                found.append(Hierarchy("v2", dict.fromkeys(V2_CONTROLLERS, parent)))
    v1 = {}
    for fstype, point, options in mounts:
        for controller in V1_CONTROLLERS:
            if fstype == "cgroup" and controller in options:
                v1[controller] = _parent(point, own.get(controller, "/"))
    if set(v1) == set(V1_CONTROLLERS):
        found.append(Hierarchy("v1", v1))
    return found


def probe() -> Hierarchy | None:
    """A hierarchy in which a group can be made, limited and removed here; None when none can."""
    try:
        candidates = _hierarchies()
    except OSError as e:
        log.info("no cgroups: cannot read this process's cgroup mounts (%s)", e)
        return None
    for hierarchy in candidates:
        try:
            CallGroup(hierarchy, memory_mb=64, processes=4).close()
        except OSError as e:
            log.info("cgroup %s at %s is not usable here: %s", hierarchy.version,
                     sorted(set(hierarchy.parents.values())), e)
            continue
        return hierarchy
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CallGroup:
    """One call's group. Made (and limited) on construction; raises OSError when that fails, after
    removing what it had made."""

    def __init__(self, hierarchy: Hierarchy, memory_mb: int, processes: int) -> None:
        self.hierarchy = hierarchy
        # random too: processes in other pid namespaces (containers) may share this pid and this hierarchy
        name = f"tidal-sandbox-{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"
        self.folders = {c: os.path.join(parent, name) for c, parent in hierarchy.parents.items()}
        self._made: list[str] = []
        try:
            for folder in dict.fromkeys(self.folders.values()):  # v2: one folder for all controllers
                os.mkdir(folder, 0o700)
                self._made.append(folder)
            self._limit(memory_mb * 1024 * 1024, processes)
        except OSError:
            self.close()
            raise
        # entered by writing 0 (the writer itself) into each hierarchy's procs file
        self.procs_files = [os.path.join(folder, "cgroup.procs") for folder in self._made]

    def _limit(self, memory: int, processes: int) -> None:
        f = self.folders
        if self.hierarchy.version == "v2":
            _write(os.path.join(f["pids"], "pids.max"), str(processes))
            _write(os.path.join(f["memory"], "memory.max"), str(memory))
            if os.path.exists(os.path.join(f["memory"], "memory.swap.max")):
                _write(os.path.join(f["memory"], "memory.swap.max"), "0")
            _write(os.path.join(f["cpu"], "cpu.max"), "100000 100000")  # one CPU at most
            return
        _write(os.path.join(f["pids"], "pids.max"), str(processes))
        _write(os.path.join(f["memory"], "memory.limit_in_bytes"), str(memory))
        if os.path.exists(os.path.join(f["memory"], "memory.memsw.limit_in_bytes")):  # memory + swap
            _write(os.path.join(f["memory"], "memory.memsw.limit_in_bytes"), str(memory))
        _write(os.path.join(f["cpu"], "cpu.cfs_period_us"), "100000")
        _write(os.path.join(f["cpu"], "cpu.cfs_quota_us"), "100000")  # one CPU at most

    def enter(self) -> None:
        """In the child between fork and exec: only os calls on paths computed beforehand."""
        for path in self.procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def cpu_seconds(self) -> float:
        """CPU time used by every process of the group so far (0.0 if it cannot be read)."""
        try:
            if self.hierarchy.version == "v2":
                with open(os.path.join(self.folders["cpu"], "cpu.stat")) as f:
                    fields = dict(line.split() for line in f if line.strip())
                return int(fields["usage_usec"]) / 1e6
            with open(os.path.join(self.folders["cpuacct"], "cpuacct.usage")) as f:
                return int(f.read()) / 1e9
        except (OSError, KeyError, ValueError):
            return 0.0

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for going over the memory total."""
        name = "memory.events" if self.hierarchy.version == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.folders["memory"], name)) as f:
                fields = dict(line.split() for line in f if line.strip())
            return int(fields.get("oom_kill", "0")) > 0
        except (OSError, ValueError):
            return False

    def close(self, timeout_s: float = 2.0) -> None:
        """Kill every process left in the group and remove it; never raises (a group that will not go
        is logged: it holds no process the sandbox could still use)."""
        deadline = time.monotonic() + timeout_s
        for folder in reversed(self._made):
            while True:
                self._kill_all(folder)
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:  # EBUSY while the killed processes exit
                    if time.monotonic() >= deadline:
                        log.warning("could not remove the sandbox's cgroup %s: %s", folder, e)
                        break
                    time.sleep(0.01)
        self._made = []

    @staticmethod
    def _kill_all(folder: str) -> None:
        try:
            if os.path.exists(os.path.join(folder, "cgroup.kill")):
                _write(os.path.join(folder, "cgroup.kill"), "1")
                return
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
