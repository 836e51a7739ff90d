"""The python tool: runs the model's code in a sandboxed subprocess, and always comes back.

Each call gets a new process, ``sys.executable -I`` (isolated: no PYTHON* variables, no user site, no
script folder on the path), started in a new session so that its whole process group can be killed, in
a fresh temporary folder (its cwd, HOME and TMPDIR) removed afterwards whatever happened, with a minimal
environment and stdin at /dev/null. Before exec the child sets rlimits: address space (memory), CPU
seconds, file size, open files.

No network, in two layers:
- a network namespace of its own (``unshare -rn``: a user namespace, so no privilege is needed) with no
  interface up, when the machine allows it (probed once per process; `network="namespace"` insists);
- always, a bootstrap that installs an audit hook (`sys.addaudithook`, which code cannot remove) before
  the model's code runs, refusing socket connect/bind/send and name look-ups; starting programs (exec,
  spawn, system, Popen), since a new program would not carry the hook; and ctypes' look-ups of C
  functions (``dlsym``), which would call libc's connect() past the socket events. A hook in the
  process it guards is a fence, not a wall (Python's own docs say as much), which is why the
  namespace comes first wherever it is available.

The parent reads stdout and stderr as they come, up to `output_bytes` together: past that it kills the
process group and answers ``output_limit`` with the first part, so a flood never lands in its memory.
A wall-clock timeout kills the process group too. Failures are results, never exceptions: ``timeout``
(wall clock or CPU), ``output_limit``, ``crash`` (nonzero exit or a signal; the tail of stderr),
``bad_arguments``. Once the program exits, the processes it left behind are killed with its group and
not waited for; one that left the group (``os.setsid``) escapes that kill but not its rlimits (nor,
with the namespace, its lack of network), and the call returns all the same.
"""

from __future__ import annotations

import functools
import os
import resource  # imported here, not in the child: an import after fork can deadlock
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from tidal.core.episodes import ToolResult
from tidal.core.protocol import ToolSpec

NETWORK_MODES = ("auto", "namespace", "audit")
STDERR_TAIL = 2048  # bytes of stderr shown for a crash

# Runs in the child before the model's code; argv[1] is that code. The hook refuses events; raising in
# it makes the audited call fail with that exception.
_BOOTSTRAP = r"""
import sys
_DENIED = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
    "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
    "ctypes.dlsym", "ctypes.dlsym/handle",
})
def _refuse(event, args, _denied=_DENIED):
    if event in _denied:
        raise PermissionError(f"{event} is not allowed here: the sandbox has no network, starts no programs "
                              "and looks up no C functions")
sys.addaudithook(_refuse)
_code = sys.argv.pop(1)
sys.argv[0] = "main.py"
del _refuse, _DENIED
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@functools.cache
def network_namespace(executable: str = sys.executable) -> str | None:
    """The ``unshare`` program when ``unshare -rn`` can start `executable` here; None when it cannot
    (no unshare, or user namespaces are off)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    try:
        done = subprocess.run([unshare, "-rn", executable, "-I", "-c", "pass"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return unshare if done.returncode == 0 else None


def _within_hard_limit(which: int, value: int) -> tuple[int, int]:
    """(soft, hard) = `value`, lowered to this process's hard limit (a child may not raise it)."""
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return value, value


class PythonTool:
    """Runs a ``code`` string in a sandboxed subprocess (see the module docstring); what it prints is the
    result."""

    def __init__(self, timeout_s: float = 10.0, cpu_seconds: int = 5, memory_mb: int = 512,
                 output_bytes: int = 16384, file_mb: int = 16, open_files: int = 64,
                 max_code_bytes: int = 65536, network: str = "auto") -> None:
        if network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {NETWORK_MODES}, got {network!r}")
        if min(timeout_s, cpu_seconds, memory_mb, output_bytes, file_mb, open_files, max_code_bytes) <= 0:
            raise ValueError("the python tool's limits must all be positive")
        if max_code_bytes > 100_000:  # the code travels as one argv string, which Linux caps at 128 KiB
            raise ValueError(f"max_code_bytes is at most 100000, got {max_code_bytes}")
        self.timeout_s, self.cpu_seconds, self.memory_mb = timeout_s, cpu_seconds, memory_mb
        self.output_bytes, self.file_mb, self.open_files = output_bytes, file_mb, open_files
        self.max_code_bytes = max_code_bytes
        self.unshare = None if network == "audit" else network_namespace(sys.executable)
        self.namespace = self.unshare is not None
        mb = 1024 * 1024
        cpu_soft = _within_hard_limit(resource.RLIMIT_CPU, cpu_seconds)[0]
        cpu_hard = _within_hard_limit(resource.RLIMIT_CPU, cpu_seconds + 1)[1]  # SIGXCPU, then SIGKILL
        self._rlimits = [(resource.RLIMIT_AS, _within_hard_limit(resource.RLIMIT_AS, memory_mb * mb)),
                         (resource.RLIMIT_CPU, (cpu_soft, cpu_hard)),
                         (resource.RLIMIT_FSIZE, _within_hard_limit(resource.RLIMIT_FSIZE, file_mb * mb)),
                         (resource.RLIMIT_NOFILE, _within_hard_limit(resource.RLIMIT_NOFILE, open_files)),
                         (resource.RLIMIT_CORE, (0, 0))]  # an abort leaves no core file behind
        if network == "namespace" and not self.namespace:
            raise ValueError("network='namespace' but `unshare -rn` does not work on this machine "
                             "(no unshare, or user namespaces are off); use network='auto' or 'audit'")
        self.spec = ToolSpec(
            name="python",
            description="Run Python code in a sandbox without network; what it prints is the result.",
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
        folder = tempfile.mkdtemp(prefix="tidal-python-")
        try:
            result = self._execute(code, folder, start)
        finally:
            _remove(folder)
        result.elapsed_s = time.monotonic() - start
        return result

    # ------------------------------------------------------------------ the child

    def _command(self, code: str) -> list[str]:
        cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, code]
        return [self.unshare, "-rn", *cmd] if self.unshare else cmd

    def _limits(self) -> None:
        """In the child between fork and exec: only setrlimit calls, of values computed beforehand (no
        imports, no locks)."""
        for which, limits in self._rlimits:
            resource.setrlimit(which, limits)

    def _execute(self, code: str, folder: str, start: float) -> ToolResult:
        # one BLAS thread: each would reserve its own buffers inside the address-space limit, and the
        # CPU limit counts all threads together anyway
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(self._command(code), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=folder, env=env, start_new_session=True,
                                    preexec_fn=self._limits, close_fds=True)
        except (OSError, subprocess.SubprocessError) as e:  # the machine's fault, not the model's: say so
            return ToolResult(content=f"could not start the sandbox: {e}", error="crash")
        deadline = start + self.timeout_s
        out, err = bytearray(), bytearray()
        stopped = ""  # why the parent stopped the child: "timeout", "output_limit"
        try:
            stopped = self._read(proc, out, err, deadline)
            if not stopped and not _exited_by(proc.pid, deadline):
                stopped = "timeout"  # closed its output but kept running
        finally:
            _kill_group(proc.pid)  # whatever is left of the group (stragglers the code started)
            _, status, usage = os.wait4(proc.pid, 0)  # reaped here, for its CPU time
            proc.returncode = os.waitstatus_to_exitcode(status)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        return self._result(proc.returncode, usage.ru_utime + usage.ru_stime, stopped, out, err)

    def _read(self, proc: subprocess.Popen, out: bytearray, err: bytearray, deadline: float) -> str:
        """Collect output until both pipes close or the program exits (what its leftover processes
        write after that is not waited for); "timeout" or "output_limit" when the child had to be
        stopped first (it is killed here)."""
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

    def _result(self, returncode: int, cpu_s: float, stopped: str, out: bytearray, err: bytearray) -> ToolResult:
        stdout, stderr = _text(out), _text(err)
        if stopped == "output_limit":
            shown = _text((out + err)[: self.output_bytes])
            return ToolResult(content=_lines(shown, f"[output stopped at {self.output_bytes} bytes; the program "
                                                    "was killed]"), error="output_limit")
        if stopped == "timeout":
            return ToolResult(content=_lines(stdout, f"[timed out after {self.timeout_s:g} s of wall time; the "
                                                     "program was killed]"), error="timeout")
        if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu_s >= self.cpu_seconds):
            # SIGXCPU at the soft limit; SIGKILL at the hard one when the code ignored SIGXCPU
            return ToolResult(content=_lines(stdout, f"[CPU time limit of {self.cpu_seconds} s exceeded; the "
                                                     "program was killed]"), error="timeout")
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


def _remove(folder: str) -> None:
    """Remove the call's folder even where the code took write permission away from its own folders."""

    def retry(function, path, _exc_info) -> None:
        os.chmod(os.path.dirname(path), stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
        function(path)

    shutil.rmtree(folder, onerror=retry)
