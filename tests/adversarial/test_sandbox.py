"""The python tool's sandbox against code that attacks the machine, with the real bubblewrap.

Each test runs an attack in the sandbox and checks it failed, and runs the same probe in a plain
subprocess first (the negative control) and checks it succeeded there: the hole is real on this machine,
so a pass is not vacuous.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidal.rollout.tools import bwrap
from tidal.rollout.tools.python import PythonTool

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 8


@pytest.fixture(scope="module", params=["auto", "rlimits"])
def tool(request: pytest.FixtureRequest) -> PythonTool:
    """The sandbox with the limits this machine allows (a cgroup where one can be made), and with rlimits
    alone: the namespaces must hold in both."""
    return PythonTool(timeout_s=3.0, cpu_seconds=2, memory_mb=160, processes=PROCESSES, limits=request.param)


def plain(code: str, env: dict[str, str] | None = None) -> str:
    """The probe outside the sandbox: what a plain subprocess of ours can do (its output goes to a file,
    so that children it leaves behind do not hold us up)."""
    with tempfile.TemporaryFile() as output:
        subprocess.run([sys.executable, "-I", "-c", code], stdout=output, stderr=subprocess.STDOUT, timeout=20,
                       env=env, stdin=subprocess.DEVNULL)
        output.seek(0)
        return output.read().decode(errors="replace")


def sandboxed(tool: PythonTool, code: str) -> str:
    result = tool.run({"code": code})
    return result.content


def processes_running(token: str) -> list[int]:
    """Host pids of live processes whose command line holds `token` (the code travels in argv)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return found


def unique(name: str) -> str:
    return f"tidal-{name}-{os.getpid()}-{time.monotonic_ns()}"


@pytest.fixture
def secrets(tmp_path: Path) -> Iterator[list[Path]]:
    """The same secret planted in the project, in $HOME and in a temporary folder outside the call's."""
    name = unique("secret")
    paths = [ROOT / f".{name}", Path.home() / f".{name}", tmp_path / "secret"]
    try:
        for path in paths:
            path.write_text(f"payload of {name}")  # not the path itself, which a probe's output may echo
        yield paths
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


@pytest.fixture
def victim() -> Iterator[subprocess.Popen]:
    """A process of ours started outside the sandbox, with a secret in its environment."""
    proc = subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin", "TIDAL_VICTIM_SECRET": "hunter2"})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_files_outside_the_call_folder_cannot_be_read(tool: PythonTool, secrets: list[Path]) -> None:
    probe = ("import os\n"
             f"for path in {[str(p) for p in secrets]!r}:\n"
             "    try:\n        print(open(path).read())\n    except OSError as e:\n        print(type(e).__name__)\n"
             f"print([os.path.exists(p) for p in ({str(ROOT)!r}, {sys.prefix!r}, {str(Path.home())!r} + '/.bashrc')])")
    secret = secrets[0].read_text()
    assert plain(probe).count(secret) == 3
    seen = sandboxed(tool, probe)
    assert secret not in seen and seen.count("FileNotFoundError") == 3, seen
    assert "[False, False, False]" in seen  # no project, no virtualenv, no home


def test_files_cannot_be_written_into_site_packages_or_the_project(tool: PythonTool) -> None:
    name = unique("written") + ".txt"  # never a .pth, which would run in every later Python process
    targets = [sysconfig.get_paths()["purelib"], str(ROOT), sysconfig.get_paths()["stdlib"], "/usr/lib", "/"]
    probe = ("import os\n"
             f"for folder in {targets!r}:\n"
             "    try:\n"
             f"        open(os.path.join(folder, {name!r}), 'w').write('x'); print('wrote', folder)\n"
             "    except OSError as e:\n        print(type(e).__name__, folder)\n")
    try:
        assert plain(probe).count("wrote") == len(targets)
    finally:
        for folder in targets:
            Path(folder, name).unlink(missing_ok=True)
    seen = sandboxed(tool, probe)
    assert "wrote" not in seen, seen
    assert not [folder for folder in targets if Path(folder, name).exists()]


def test_the_hosts_disk_cannot_be_filled(tmp_path: Path) -> None:
    fill = ("import os\nwritten = 0\nfor i in range(6):\n    try:\n"
            "        open(os.path.join(os.environ.get('TMPDIR', '.'), f'fill{i}'), 'wb').write(b'x' * 2**22)\n"
            "        written += 4\n    except OSError as e:\n        print(e.strerror); break\nprint('wrote', written, 'MB')\n")
    assert "wrote 24 MB" in plain(fill, env={"TMPDIR": str(tmp_path)})  # tmp_path is removed by pytest
    seen = sandboxed(PythonTool(timeout_s=5.0, disk_mb=8), fill)
    assert "No space left on device" in seen and "wrote 24" not in seen, seen


def test_programs_it_starts_see_no_files_and_no_network(tool: PythonTool, secrets: list[Path]) -> None:
    """The audit hook of old could not see _posixsubprocess.fork_exec; the sandbox does not need to:
    a program started inside is inside too."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    try:
        port = server.getsockname()[1]
        script = (f"cat {secrets[0]} {secrets[1]}; echo sh-ran; "
                  f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)\"")
        probe = ("import _posixsubprocess, os, subprocess\n"
                 f"print(subprocess.run(['/bin/sh', '-c', {script!r}], capture_output=True, text=True))\n")
        secret = secrets[0].read_text()
        seen_plain = plain(probe)
        assert secret in seen_plain and "sh-ran" in seen_plain
        server.accept()[0].close()  # the control did connect
        seen = sandboxed(tool, probe)
        assert "sh-ran" in seen and secret not in seen and "Connection refused" in seen, seen
        with pytest.raises(TimeoutError):
            server.accept()[0].close()
    finally:
        server.close()


def test_processes_are_bounded_in_number_and_a_fork_bomb_returns_in_time(tool: PythonTool) -> None:
    if tool.limits == "rlimits" and os.geteuid() == 0:
        pytest.skip("limits by rlimits and the sandbox's processes are root outside it: nothing bounds their number")
    token = unique("forks")
    count = ("import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30); os._exit(0)\n"
             f"    n += 1\nprint('forked', n)\n# {token}")
    try:
        assert "forked 64" in plain(count)  # unbounded outside (the children die below)
    finally:
        for pid in processes_running(token):
            os.kill(pid, signal.SIGKILL)
    seen = sandboxed(tool, count)
    forked = int(seen.split("forked ")[1].split()[0])
    assert 0 < forked <= PROCESSES, seen
    bomb = f"import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n# {token}"
    started = time.monotonic()
    result = tool.run({"code": bomb})
    assert result.error == "timeout" and time.monotonic() - started < tool.timeout_s + 2.0, result
    assert processes_running(token) == []


def test_a_setsid_daemon_is_dead_when_the_call_returns(tool: PythonTool) -> None:
    token = unique("daemon")
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        while True: sum(range(10**5))\n    os._exit(0)\n"
              f"time.sleep(0.2)\nprint('started')\n# {token}")
    try:
        assert "started" in plain(daemon)
        assert processes_running(token), "the control's daemon should outlive its call"
    finally:
        for pid in processes_running(token):
            os.kill(pid, signal.SIGKILL)
    result = tool.run({"code": daemon})
    assert result.error == "" and "started" in result.content, result
    assert processes_running(token) == []


def test_signals_cannot_reach_our_processes(tool: PythonTool, victim: subprocess.Popen) -> None:
    assert "ok" in plain(f"import os; os.kill({victim.pid}, 0); print('ok')")  # we could kill it
    probe = (f"import os, signal\nprint({str(victim.pid)!r} in os.listdir('/proc'))\n"
             f"try:\n    os.kill({victim.pid}, signal.SIGKILL)\nexcept OSError as e:\n    print(type(e).__name__)\n"
             "os.kill(-1, signal.SIGKILL)\n")  # everything it may signal: only the sandbox
    seen = sandboxed(tool, probe)
    assert seen.startswith("False\nProcessLookupError"), seen
    time.sleep(0.1)
    assert victim.poll() is None


def test_memory_is_bounded_across_children(tool: PythonTool) -> None:
    if tool.limits == "rlimits":
        pytest.skip("limits by rlimits: memory is limited per process only")
    token = unique("hog")
    # four children of 64 MB each, each within the 160 MB per-process limit, 256 MB together: how many
    # hold theirs at the same time?
    hog = ("import os, time\npids = []\nfor _ in range(4):\n    r, w = os.pipe()\n    pid = os.fork()\n"
           "    if pid == 0:\n        block = b'x' * (64 * 2**20); os.write(w, b'1'); time.sleep(30); os._exit(0)\n"
           "    os.close(w); os.read(r, 1); pids.append(pid)\n"
           "print('alive', sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids), flush=True)\n"
           f"# {token}")
    try:
        assert "alive 4" in plain(hog)
    finally:
        for pid in processes_running(token):
            os.kill(pid, signal.SIGKILL)
    seen = sandboxed(tool, hog)
    assert "alive 4" not in seen and "went over 160 MB" in seen, seen


def test_network_cannot_reach_a_loopback_port_we_listen_on(tool: PythonTool) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    try:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1); print('connected')"
        assert "connected" in plain(probe)
        server.accept()[0].close()
        seen = sandboxed(tool, probe)
        assert "ConnectionRefusedError" in seen and "connected" not in seen, seen
        with pytest.raises(TimeoutError):
            server.accept()[0].close()
    finally:
        server.close()


def test_environment_holds_no_secret_of_ours(tool: PythonTool, victim: subprocess.Popen,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_PARENT_SECRET", "swordfish")
    probe = ("import os\nprint(os.environ.get('TIDAL_PARENT_SECRET'))\n"
             f"for path in ('/proc/{victim.pid}/environ', '/proc/1/environ'):\n"
             "    try:\n        print(open(path, 'rb').read())\n    except OSError as e:\n        print(type(e).__name__)\n")
    seen_plain = plain(probe, env=dict(os.environ))
    assert "swordfish" in seen_plain and "hunter2" in seen_plain
    seen = sandboxed(tool, probe)
    assert "swordfish" not in seen and "hunter2" not in seen and seen.startswith("None\nFileNotFoundError"), seen


def test_no_user_namespace_can_be_made_inside(tool: PythonTool) -> None:
    if "--disable-userns" not in bwrap.options(tool.bwrap):
        pytest.skip("this bubblewrap is older than 0.8 and cannot forbid user namespaces inside")
    probe = "import subprocess; print(subprocess.run(['unshare', '--user', 'true']).returncode)"
    assert plain(probe).strip() == "0"
    seen = sandboxed(tool, probe)
    assert seen.startswith("1\n") and "unshare failed" in seen, seen


def test_it_runs_as_nobody_without_capabilities_and_cannot_write_proc(tool: PythonTool) -> None:
    # writes back the value it read: the control, run by root, must not change the machine
    sysctl = ("try:\n    v = open('/proc/sys/vm/overcommit_ratio').read()\n"
              "    open('/proc/sys/vm/overcommit_ratio', 'w').write(v); print('wrote sysctl')\n"
              "except OSError as e:\n    print(type(e).__name__)\n")
    if os.geteuid() == 0:  # (any other user cannot write it outside either)
        assert "wrote sysctl" in plain(sysctl)
    probe = ("import os\nprint(os.getuid(), os.getgid())\n"
             "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])\n"
             "print(sorted(os.listdir('/')))\n" + sysctl)
    seen = sandboxed(tool, probe).splitlines()
    assert seen[0] == "65534 65534" and int(seen[1], 16) == 0, seen
    assert "work" not in seen[2] and "home" not in seen[2], seen
    assert seen[3] == "OSError", seen  # EROFS: its /proc is read-only
