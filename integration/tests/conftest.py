"""Shared by the system tests that drive `tidal run` as a user does (a subprocess, its own process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"


class TidalCLI:
    """`tidal run` on the tiny recipe, with role logs for failure messages."""

    @staticmethod
    def logs(run_dir: Path) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                       for p in sorted((run_dir / "logs").glob("*.log")))

    def run(self, world: tuple[Path, dict], run_dir: Path, *overrides: str, timeout: float = 420) -> tuple[int, str]:
        """(exit code, its output) of `tidal run` with `world` = (model folder, environment). Killed, and
        the test failed, past `timeout`: a run that cannot finish must end by itself, with a status."""
        model, env = world
        # these runs test plumbing and failures on untrained models, which learn nothing by design: they end
        # "completed" (test_no_signal.py turns the verdict back on)
        args = [sys.executable, "-m", "tidal.integration.cli", "run", str(RECIPE), f'model="{model}"',
                f'run_dir="{run_dir}"', 'monitor.progress="log"', "monitor.tensorboard=false",
                "launch.fail_without_signal=false", *overrides]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
            pytest.fail(f"tidal run did not end within {timeout} s:\n{out[-4000:]}{self.logs(run_dir)}")
        return proc.returncode, out


@pytest.fixture
def tidal_cli() -> TidalCLI:
    return TidalCLI()


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> Path:
    """One folder for the whole test session, shared by side-by-side xdist workers (their base temp folders
    are siblings), where warm starts are built once (`tidal.integration.sft.built_once`)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if base.name.startswith("popen-gw") else base) / "warm-starts"
