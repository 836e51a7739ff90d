"""Fixtures for tidal-core tests: real server processes that are always stopped."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def server_process() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    """Start `serve.py` in a real process; returns (process, endpoint). Killed at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "serve.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        line = proc.stdout.readline().strip()  # the server prints its endpoint once bound
        if not line.startswith("tcp://"):
            proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()}")
        return proc, line

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
