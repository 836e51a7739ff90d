"""The whole of Tidal in a fresh venv, built from this checkout's wheels, beside an outside package: what
an author who writes an environment package gets (tests/test_env_guess_example.py,
tests/test_writing_an_environment.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "integration" / "tests" / "recipes" / "tiny.toml"

# A tiny model whose character tokenizer covers printable ASCII (the default alphabet has no `{ } " < > _`),
# built in the venv, and the distributions that provide `sys.argv[2]` (an env plugin name).
PREPARE = textwrap.dedent('''
    import json, string, sys
    from importlib.metadata import entry_points
    from tidal.rollout.tiny import build_tiny_model

    build_tiny_model(sys.argv[1], alphabet="".join(dict.fromkeys(string.printable)))
    print(json.dumps(sorted(ep.dist.name for ep in entry_points(group="tidal") if ep.name == sys.argv[2])))
''')


def workspace_dists() -> list[str]:
    """The distribution names of the workspace members (packages/* and integration, i.e. `tidal`)."""
    folders = [*sorted((ROOT / "packages").glob("*/pyproject.toml")), ROOT / "integration" / "pyproject.toml"]
    return [tomllib.loads(p.read_text())["project"]["name"] for p in folders]


def tidal_venv(tmp: Path, outside: Path) -> str:
    """A fresh venv holding every workspace member and the outside package at `outside`; its python."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import check_package_alone as alone
    finally:
        sys.path.remove(str(ROOT / "tools"))
    dists = workspace_dists()
    wheels = alone.build_wheels([*dists, outside], tmp / "dist")
    assert len(wheels) == len(dists) + 1, wheels
    t0 = time.perf_counter()
    py = alone.fresh_venv(tmp / "venv", wheels)
    print(f"installed {len(wheels)} wheels with their PyPI dependencies in {time.perf_counter() - t0:.1f} s")
    return py


def env_logs(run_dir: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                   for p in sorted((run_dir / "logs").glob("*.log")))


def tidal_run(py: str, cwd: Path, run_dir: Path, *overrides: str, timeout: float = 420,
              recipe: Path = RECIPE) -> tuple[int, str, float]:
    """`tidal run` in the venv (its own session, killed whole at `timeout`): (return code, output, seconds)."""
    args = [py, "-m", "tidal.integration.cli", "run", str(recipe), f'run_dir="{run_dir}"', *overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"tidal run did not end within {timeout:g} s:\n{out[-4000:]}{env_logs(run_dir)}") from None
    return proc.returncode, out, time.monotonic() - t0
