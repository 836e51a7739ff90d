"""The calculator and the sandboxed python tool, for real: values, refusals, and every way a program can
misbehave (spin, sleep, flood, crash, hog memory, reach the network) coming back as a result in time."""

from __future__ import annotations

import os
import socket
import time
import tracemalloc
from pathlib import Path

import pytest

from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.rollout.tools.calculator import Calculator
from tidal.rollout.tools.python import PythonTool


@pytest.mark.parametrize(("expression", "value"), [
    ("347*58", "20126"), ("1+2*3", "7"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("6/3", "2"), ("7//2", "3"),
    ("-7//2", "-4"), ("7%3", "1"), ("2**10", "1024"), ("2**-2", "0.25"), ("1.5*4", "6"), ("-(3-5)", "2"),
    (" 12 + 30 ", "42"), ("1/3", "0.333333333333"), ("10**29", "100000000000000000000000000000"),
])
def test_calculator_values_print_integers_as_ints(expression: str, value: str) -> None:
    result = Calculator().run({"expression": expression})
    assert (result.error, result.content) == ("", value)


@pytest.mark.parametrize(("arguments", "says"), [
    ({"expression": "__import__('os')"}, "not Call"),
    ({"expression": "x+1"}, "not Name"),
    ({"expression": "1+"}, "cannot read"),
    ({"expression": "1/0"}, "division by zero"),
    ({"expression": "0**-1"}, "division by zero"),
    ({"expression": "2**1000"}, "exponent too large"),
    ({"expression": "9**9**9"}, "exponent too large"),
    ({"expression": "10**40"}, "too large"),
    ({"expression": "99999999999**3"}, "too large"),
    ({"expression": "1e308*10"}, "too large"),
    ({"expression": "(-8)**0.5"}, "no real value"),
    ({"expression": "1" * 201}, "too long"),
    ({"expression": ""}, "empty"),
    ({"expression": "True+1"}, "not Constant"),
    ({"expression": "[1]*3"}, "not"),
    ({}, "expression string"),
    ({"expression": 12}, "expression string"),
])
def test_calculator_refuses_with_a_clear_message(arguments: dict, says: str) -> None:
    started = time.monotonic()
    result = Calculator().run(arguments)
    assert result.error == "bad_arguments" and says in result.content, result
    assert time.monotonic() - started < 0.1  # bounded before computing, not after


def test_tools_are_registered_and_their_options_checked() -> None:
    assert {"calculator", "python"} <= set(registry.names("tool"))
    assert registry.build("tool", "calculator", {"max_exponent": 3}).run({"expression": "2**4"}).error
    with pytest.raises(ConfigError, match="timeout_s"):
        registry.build("tool", "python", {"timeout": 1})
    with pytest.raises(ConfigError, match="limits"):
        registry.build("tool", "python", {"limits": "none"})


# --------------------------------------------------------------------------- python


@pytest.fixture(scope="module")
def python() -> PythonTool:
    return PythonTool(timeout_s=2.0, cpu_seconds=1, memory_mb=256)


def run_timed(tool: PythonTool, code: str) -> tuple[object, float]:
    started = time.monotonic()
    result = tool.run({"code": code})
    return result, time.monotonic() - started


def test_python_returns_what_the_program_prints(python: PythonTool) -> None:
    result, _ = run_timed(python, "import sys\nprint(6*7)\nprint('note', file=sys.stderr)")
    assert result.error == "" and result.content == "42\nnote\n" and result.elapsed_s > 0


def test_python_has_the_standard_library_only_and_says_which_limits_apply() -> None:
    tool = PythonTool()
    result = tool.run({"code": "import json, math; print(json.dumps(math.comb(5, 2)))\nimport numpy"})
    assert result.error == "crash" and result.content.startswith("10\n"), result
    assert "No module named 'numpy'" in result.content  # the virtualenv is not in the sandbox
    result = tool.run({"code": "import pip"})  # nor the base installation's site-packages
    assert "No module named 'pip'" in result.content, result
    assert tool.limits in ("cgroup v1", "cgroup v2", "rlimits")


def test_python_refuses_arguments_that_are_not_code(python: PythonTool) -> None:
    assert python.run({}).error == "bad_arguments"
    assert python.run({"code": 3}).error == "bad_arguments"
    assert python.run({"code": "x" * 70_000}).error == "bad_arguments"


def test_python_busy_loop_is_stopped_by_the_cpu_limit() -> None:
    # a wall clock far away, so that the CPU limit (1 s) is what stops it even on a loaded machine
    result, took = run_timed(PythonTool(timeout_s=20.0, cpu_seconds=1), "while True: pass")
    assert result.error == "timeout" and "CPU time limit of 1 s" in result.content
    assert took < 10.0


def test_python_sleep_is_stopped_by_the_wall_clock(python: PythonTool) -> None:
    result, took = run_timed(python, "import time; print('start', flush=True); time.sleep(10**6)")
    assert result.error == "timeout" and result.content.startswith("start\n") and "wall time" in result.content
    assert 2.0 <= took < 3.0


@pytest.mark.parametrize("code", ["print('x' * 10**8)", "while True: print('y' * 100)"])
def test_python_output_flood_is_cut_at_the_cap_and_never_buffered(python: PythonTool, code: str) -> None:
    tracemalloc.start()
    try:
        result, took = run_timed(python, code)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.error == "output_limit" and took < 1.5  # far before the 2 s wall clock
    assert result.content[:16384].strip("xy\n") == "" and "stopped at 16384 bytes" in result.content
    assert len(result.content) < 17_000
    assert peak < 4 * 1024 * 1024  # the parent held about the cap, never the 100 MB


def test_python_crash_reports_the_signal_and_the_traceback(python: PythonTool) -> None:
    result, _ = run_timed(python, "import os; os.abort()")
    assert result.error == "crash" and "SIGABRT" in result.content
    result, _ = run_timed(python, "print('before')\nraise ValueError('boom')")
    assert result.error == "crash" and result.content.startswith("before\n")
    assert "ValueError: boom" in result.content and "[exit status 1]" in result.content


def test_python_memory_hog_hits_the_address_space_limit(python: PythonTool) -> None:
    result, took = run_timed(python, "x = bytearray(1024**3)\nprint('allocated')")
    assert result.error == "crash" and "MemoryError" in result.content and "allocated" not in result.content
    assert took < 1.5


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    yield server
    server.close()


def assert_never_connected(server: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        server.accept()[0].close()


def test_python_cannot_reach_the_network(python: PythonTool, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    for code in (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 f"import socket; s = socket.socket(); s.settimeout(1); s.connect(('127.0.0.1', {port}))",
                 "import socket; socket.getaddrinfo('example.com', 80)"):
        result, _ = run_timed(python, code)
        assert result.error == "crash" and ("ConnectionRefusedError" in result.content or "gaierror" in result.content), result
    assert_never_connected(listener)


def test_python_runs_in_a_network_namespace_with_only_a_loopback(python: PythonTool) -> None:
    result, _ = run_timed(python, "import os; print(os.readlink('/proc/self/ns/net')); print(open('/proc/net/dev').read())")
    namespace, devices = result.content.split("\n", 1)
    assert namespace != os.readlink("/proc/self/ns/net")
    assert [line.split(":")[0].strip() for line in devices.splitlines()[2:] if line.strip()] == ["lo"]


def test_python_folder_is_fresh_in_every_call_and_nothing_of_it_reaches_the_host(python: PythonTool) -> None:
    token = f"tidal-folder-{os.getpid()}-{time.monotonic_ns()}"
    code = f"import os; print(os.getcwd(), os.listdir('.')); open('{token}', 'w').write('x')"
    first, _ = run_timed(python, code)
    second, _ = run_timed(python, code)
    assert first.content == second.content == "/tmp []\n", (first, second)  # the first call's file is gone
    assert not list(Path("/tmp").glob(f"**/{token}"))  # and it never was on the host's disk


def test_python_environment_is_minimal(python: PythonTool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_SECRET_FOR_TEST", "do-not-leak")
    result, _ = run_timed(python, "import os, sys; print(sorted(os.environ)); print(sys.flags.isolated)")
    names, isolated = result.content.splitlines()
    assert "TIDAL_SECRET_FOR_TEST" not in names and isolated == "1"


def processes_running(token: str) -> list[int]:
    """Host pids of live processes whose command line holds `token` (the sandbox's processes carry the
    code in their argv; a zombie's command line is empty)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return found


def test_python_background_children_are_killed_and_not_waited_for(python: PythonTool) -> None:
    token = f"tidal-child-{os.getpid()}-{time.monotonic_ns()}"
    result, took = run_timed(python, f"import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(100)\nprint('{token}')")
    assert result.error == "" and took < 1.5, result  # not held to the 2 s wall clock by the child
    assert processes_running(token) == []  # the pid namespace took it down with the program
