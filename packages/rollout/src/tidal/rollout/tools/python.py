"""The python tool: runs the model's code in a bubblewrap sandbox, and always comes back.

Each call gets a new sandbox (`tidal.rollout.tools.bwrap`, whose docstring lists what the code can see):
the base interpreter (``-I``, no virtualenv, the standard library only) with a read-only view of the
system's programs and libraries and nothing of the user's; an empty /tmp of `disk_mb` of its own, its cwd,
HOME and TMPDIR and its only writable place (a tmpfs: nothing lands on the host's disk, and nothing is
left to remove); its own user, pid, network (loopback only), ipc and uts namespaces, uid 65534 with no
capabilities, a read-only /proc, a clean environment and stdin at /dev/null. bwrap's init is pid 1 in
there, so when the program exits, or the sandbox is killed, every process it started dies with it
(``setsid`` daemons too).

Limits, for the call as a whole where the machine lets us make a cgroup (v2, else v1; `limits` says
which applied, and the first construction logs it): at most `processes` processes and threads, at most
`memory_mb` of memory without swap, one CPU's worth of time and `cpu_seconds` of CPU in all. Always, per
process, rlimits: address space (`memory_mb`, which turns a large allocation into a MemoryError), CPU
seconds, file size, open files, no core files; and RLIMIT_NPROC inside the sandbox's user namespace (a
bound on the call's processes, but not where the environment process runs as root: the kernel exempts
root's processes from it, and then only a cgroup bounds them). Without a cgroup `limits` is "rlimits".

bubblewrap is required: where it is missing or cannot start a sandbox, construction raises
`SandboxUnavailable` saying how to install it; there is no unsandboxed fallback.

The parent reads stdout and stderr as they come, up to `output_bytes` together: past that it kills the
sandbox and answers ``output_limit`` with the first part, so a flood never lands in its memory. A
wall-clock timeout kills it too. Failures are results, never exceptions: ``timeout`` (wall clock or CPU),
``output_limit``, ``crash`` (nonzero exit or a signal; the tail of stderr), ``bad_arguments``. bwrap
reports a death by signal N as exit status 128+N, and so does this tool ("killed by SIGABRT").

What this does not protect against: the sandbox shares the kernel, so a kernel exploit escapes it; the
code can measure time and CPU contention (side channels on the same machine); it can use its CPU and
memory budget in full; its /proc still shows machine-wide figures (cpuinfo, meminfo, loadavg). Where the
environment process runs as root, the sandbox's processes are root outside it too (without
capabilities, confined by the namespaces): running environment processes as an ordinary user adds a
layer.
"""

from __future__ import annotations

import functools
import logging
import os
import resource  # imported here, not in the child: an import after fork can deadlock
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

from tidal.core.episodes import ToolResult
from tidal.core.protocol import ToolSpec
from tidal.rollout.tools import bwrap, cgroups

log = logging.getLogger(__name__)
LIMITS_MODES = ("auto", "cgroup", "rlimits")
STDERR_TAIL = 2048  # bytes of stderr shown for a crash
_SANDBOX_PROCESSES = 2  # bwrap's init and the interpreter, besides what the code starts

# Runs in the sandbox before the model's code: argv[1] is the process bound, argv[2] the code. Lowered
# here, after bwrap made the user namespace, RLIMIT_NPROC counts only the sandbox's processes.
_BOOTSTRAP = r"""
import resource, sys
_n, _hard = int(sys.argv.pop(1)), resource.getrlimit(resource.RLIMIT_NPROC)[1]
_n = _n if _hard == resource.RLIM_INFINITY else min(_n, _hard)
resource.setrlimit(resource.RLIMIT_NPROC, (_n, _n))
_code = sys.argv.pop(1)
sys.argv[0] = "main.py"
del _n, _hard, resource
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_reported: set[str] = set()


def _within_hard_limit(which: int, value: int) -> tuple[int, int]:
    """(soft, hard) = `value`, lowered to this process's hard limit (a child may not raise it)."""
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return value, value


class PythonTool:
    """Runs a ``code`` string in a bubblewrap sandbox (see the module docstring); what it prints is the
    result. Raises `bwrap.SandboxUnavailable` when no sandbox can be started here."""

    def __init__(self, timeout_s: float = 10.0, cpu_seconds: int = 5, memory_mb: int = 512,
                 output_bytes: int = 16384, file_mb: int = 16, open_files: int = 64,
                 max_code_bytes: int = 65536, processes: int = 32, disk_mb: int = 64,
                 limits: str = "auto") -> None:
        if limits not in LIMITS_MODES:
            raise ValueError(f"limits must be one of {LIMITS_MODES}, got {limits!r}")
        if min(timeout_s, cpu_seconds, memory_mb, output_bytes, file_mb, open_files, max_code_bytes,
               processes, disk_mb) <= 0:
            raise ValueError("the python tool's limits must all be positive")
        if max_code_bytes > 100_000:  # the code travels as one argv string, which Linux caps at 128 KiB
            raise ValueError(f"max_code_bytes is at most 100000, got {max_code_bytes}")
        self.timeout_s, self.cpu_seconds, self.memory_mb = timeout_s, cpu_seconds, memory_mb
        self.output_bytes, self.file_mb, self.open_files = output_bytes, file_mb, open_files
        self.max_code_bytes, self.processes, self.disk_mb = max_code_bytes, processes, disk_mb
        self.bwrap = bwrap.find()
        self.interpreter = bwrap.interpreter()
        self.hierarchy = None if limits == "rlimits" else _hierarchy()
        if limits == "cgroup" and self.hierarchy is None:
            raise ValueError("limits='cgroup' but no cgroup can be made here (cgroup v2 with pids, memory "
                             "and cpu delegated to this process, or writable cgroup v1 pids, memory, cpu "
                             "and cpuacct hierarchies, as root); use limits='auto' or 'rlimits'")
        self.limits = f"cgroup {self.hierarchy.version}" if self.hierarchy else "rlimits"
        if self.limits not in _reported:
            _reported.add(self.limits)
            if self.hierarchy is None and os.geteuid() == 0:
                log.warning("python tool: bubblewrap sandbox, limits by rlimits, and no bound on the number "
                            "of processes of a call: they run as root outside the sandbox, which RLIMIT_NPROC "
                            "exempts; run the environment processes as an ordinary user, or where a cgroup "
                            "can be made (see tidal.rollout.tools.cgroups)")
            else:
                log.info("python tool: bubblewrap sandbox, limits on each call by %s", self.limits)
        mb = 1024 * 1024
        cpu_soft = _within_hard_limit(resource.RLIMIT_CPU, cpu_seconds)[0]
        cpu_hard = _within_hard_limit(resource.RLIMIT_CPU, cpu_seconds + 1)[1]  # SIGXCPU, then SIGKILL
        self._rlimits = [(resource.RLIMIT_AS, _within_hard_limit(resource.RLIMIT_AS, memory_mb * mb)),
                         (resource.RLIMIT_CPU, (cpu_soft, cpu_hard)),
                         (resource.RLIMIT_FSIZE, _within_hard_limit(resource.RLIMIT_FSIZE, file_mb * mb)),
                         (resource.RLIMIT_NOFILE, _within_hard_limit(resource.RLIMIT_NOFILE, open_files)),
                         (resource.RLIMIT_CORE, (0, 0))]  # an abort leaves no core file behind
        self.spec = ToolSpec(
            name="python",
            description="Run Python code (standard library only) in a sandbox without network; what it "
                        "prints is the result.",
            parameters={"type": "object", "required": ["code"],
                        "properties": {"code": {"type": "string", "description": "a Python program"}}})

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        start = time.monotonic()
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(content=f"python needs a code string, got {type(code).__name__}",
                              error="bad_arguments")
        if "\x00" in code or len(code.encode()) > self.max_code_bytes:
            return ToolResult(content=f"code must be at most {self.max_code_bytes} bytes without NUL characters",
                              error="bad_arguments")
        result = self._execute(code, start)
        result.elapsed_s = time.monotonic() - start
        return result

    # ------------------------------------------------------------------ the child

    def _command(self, code: str) -> list[str]:
        argv = [self.interpreter, "-I", "-c", _BOOTSTRAP, str(self.processes + _SANDBOX_PROCESSES), code]
        return bwrap.command(self.bwrap, argv, self.disk_mb)

    def _execute(self, code: str, start: float) -> ToolResult:
        try:
            group = cgroups.CallGroup(self.hierarchy, self.memory_mb, self.processes + _SANDBOX_PROCESSES + 1) \
                if self.hierarchy else None  # + 1: bwrap itself, outside the namespaces
        except OSError as e:  # the machine's fault, not the model's: say so
            return ToolResult(content=f"could not make the sandbox's cgroup: {e}", error="crash")
        rlimits = self._rlimits

        def limits() -> None:
            # in the child between fork and exec: only os calls with values computed beforehand (no
            # imports, no locks)
            if group is not None:
                group.enter()
            for which, values in rlimits:
                resource.setrlimit(which, values)

        try:
            return self._supervise(self._command(code), limits, group, start)
        finally:
            if group is not None:
                group.close()

    def _supervise(self, cmd: list[str], limits: Callable[[], None], group: cgroups.CallGroup | None,
                   start: float) -> ToolResult:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={}, start_new_session=True, preexec_fn=limits, close_fds=True)
        except (OSError, subprocess.SubprocessError) as e:  # the machine's fault, not the model's: say so
            return ToolResult(content=f"could not start the sandbox: {e}", error="crash")
        deadline = start + self.timeout_s
        out, err = bytearray(), bytearray()
        stopped = ""  # why the parent stopped the sandbox: "timeout", "cpu", "output_limit"
        try:
            stopped = self._read(proc, out, err, deadline, group)
            if not stopped and not _exited_by(proc.pid, deadline):
                stopped = "timeout"  # closed its output but kept running
        finally:
            _kill_group(proc.pid)  # bwrap; its init, and with it every process inside, dies with it
            _, status, usage = os.wait4(proc.pid, 0)  # reaped here, for its CPU time
            proc.returncode = os.waitstatus_to_exitcode(status)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        returncode = proc.returncode
        if 128 < returncode <= 128 + 64:  # bwrap passes on a death by signal N as 128 + N
            returncode = 128 - returncode
        cpu_s = group.cpu_seconds() if group else usage.ru_utime + usage.ru_stime
        oom = group.oom_killed() if group else False
        return self._result(returncode, cpu_s, stopped, out, err, oom)

    def _read(self, proc: subprocess.Popen, out: bytearray, err: bytearray, deadline: float,
              group: cgroups.CallGroup | None) -> str:
        """Collect output until both pipes close or the program exits; "timeout", "cpu" (the call's
        processes together used `cpu_seconds`) or "output_limit" when the sandbox had to be stopped first
        (it is killed here)."""
        assert proc.stdout is not None and proc.stderr is not None
        buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _kill_group(proc.pid)
                    return "timeout"
                if group is not None and group.cpu_seconds() > self.cpu_seconds:
                    _kill_group(proc.pid)
                    return "cpu"
                exited = _has_exited(proc.pid)
                # while it runs, wake now and then to notice an exit that left the pipes open (a child
                # it started holds them); once it is gone, only drain what is already there
                ready = selector.select(0 if exited else min(remaining, 0.05))
                if exited and not ready:
                    return ""
                for key, _ in ready:
                    room = self.output_bytes + 1 - len(out) - len(err)
                    chunk = os.read(key.fd, max(1, min(65536, room)))
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffers[key.fd].extend(chunk)
                    if len(out) + len(err) > self.output_bytes:
                        _kill_group(proc.pid)
                        return "output_limit"
        return ""

    def _result(self, returncode: int, cpu_s: float, stopped: str, out: bytearray, err: bytearray,
                oom: bool) -> ToolResult:
        stdout, stderr = _text(out), _text(err)
        if stopped == "output_limit":
            shown = _text((out + err)[: self.output_bytes])
            return ToolResult(content=_lines(shown, f"[output stopped at {self.output_bytes} bytes; the program "
                                                    "was killed]"), error="output_limit")
        if stopped == "timeout":
            return ToolResult(content=_lines(stdout, f"[timed out after {self.timeout_s:g} s of wall time; the "
                                                     "program was killed]"), error="timeout")
        if stopped == "cpu" or returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL
                                                                 and cpu_s >= self.cpu_seconds):
            # SIGXCPU at the soft limit; SIGKILL at the hard one when the code ignored SIGXCPU
            return ToolResult(content=_lines(stdout, f"[CPU time limit of {self.cpu_seconds} s exceeded; the "
                                                     "program was killed]"), error="timeout")
        if oom:
            return ToolResult(content=_lines(stdout, stderr[-STDERR_TAIL:], f"[the call's processes together "
                                             f"went over {self.memory_mb} MB of memory; killed]"), error="crash")
        if returncode != 0:
            how = f"killed by {_signal_name(-returncode)}" if returncode < 0 else f"exit status {returncode}"
            return ToolResult(content=_lines(stdout, stderr[-STDERR_TAIL:], f"[{how}]"), error="crash")
        return ToolResult(content=stdout + stderr)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _lines(*parts: str) -> str:
    return "\n".join(part.rstrip("\n") for part in parts if part.strip())


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _has_exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it (so its process group id cannot be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _exited_by(pid: int, deadline: float) -> bool:
    """Wait, without reaping, until `pid` exits or the deadline passes."""
    while not _has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


@functools.cache  # probed once per process: it makes and removes a group
def _hierarchy() -> cgroups.Hierarchy | None:
    return cgroups.probe()
