"""The python tool's sandbox machinery with the real bubblewrap: refusal without it, the limits in each
mode, the call's cgroup removed, the folder's size bound. (The attacks themselves are in the
top-level tests/adversarial/test_sandbox.py.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tidal.rollout.tools import bwrap, python
from tidal.rollout.tools.python import PythonTool


@pytest.fixture
def fresh_probe() -> object:
    """find() caches the bwrap it proved; these tests change what it finds, then forget it again."""
    bwrap.find.cache_clear()
    yield None
    bwrap.find.cache_clear()


def test_without_bwrap_the_tool_refuses_and_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: object) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no bwrap on it
    with pytest.raises(bwrap.SandboxUnavailable, match="apt-get install bubblewrap") as caught:
        PythonTool()
    assert "not on PATH" in str(caught.value) and "bwrap --unshare-all" in str(caught.value)


def test_a_bwrap_that_cannot_start_a_sandbox_is_refused_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: object) -> None:
    broken = tmp_path / "bwrap"  # what a machine with user namespaces turned off answers
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(bwrap.SandboxUnavailable, match="No permissions to create new namespace") as caught:
        PythonTool()
    assert "unprivileged_userns_clone" in str(caught.value) and "apt-get install bubblewrap" in str(caught.value)


def test_the_limits_mechanism_is_named_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    python._reported.clear()
    with caplog.at_level(logging.INFO, logger="tidal.rollout.tools.python"):
        first, second = PythonTool(), PythonTool()
    assert first.limits == second.limits and first.limits in ("cgroup v1", "cgroup v2", "rlimits")
    lines = [r.getMessage() for r in caplog.records if "bubblewrap sandbox" in r.getMessage()]
    assert len(lines) == 1 and first.limits in lines[0]
    with pytest.raises(ValueError, match="limits must be one of"):
        PythonTool(limits="none")


def test_rlimits_mode_still_limits_each_process() -> None:
    tool = PythonTool(timeout_s=10.0, cpu_seconds=1, memory_mb=128, limits="rlimits")
    assert tool.limits == "rlimits"
    assert tool.run({"code": "print(sum(range(10)))"}).content == "45\n"
    assert "MemoryError" in tool.run({"code": "x = bytearray(1024**3)"}).content
    assert "CPU time limit of 1 s" in tool.run({"code": "while True: pass"}).content


def test_each_call_leaves_no_cgroup_behind() -> None:
    tool = PythonTool(timeout_s=1.0)
    if tool.hierarchy is None:
        pytest.skip(f"no cgroup can be made here (limits: {tool.limits})")
    for code in ("print(1)", "import time; time.sleep(5)", "import os\nfor _ in range(3): os.fork()"):
        tool.run({"code": code})
    prefix = f"tidal-sandbox-{os.getpid()}-"
    left = [name for parent in set(tool.hierarchy.parents.values()) for name in os.listdir(parent)
            if name.startswith(prefix)]
    assert left == []


def test_exit_statuses_and_signals_come_through_bwrap() -> None:
    tool = PythonTool(timeout_s=2.0)
    assert "[exit status 3]" in tool.run({"code": "import sys; sys.exit(3)"}).content
    assert "[killed by SIGSEGV]" in tool.run({"code": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"}).content


def test_the_folder_holds_at_most_disk_mb() -> None:
    tool = PythonTool(timeout_s=5.0, disk_mb=4)
    code = ("import os\nfor i in range(8):\n    try:\n        open(f'f{i}', 'wb').write(os.urandom(2**20))\n"
            "    except OSError as e:\n        print(i, e.strerror); break\n")
    assert tool.run({"code": code}).content.startswith(("3 No space left", "4 No space left"))
