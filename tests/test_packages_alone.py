"""Every package installs alone in a fresh venv and its README example runs there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_each_package_installs_alone_and_its_readme_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_package_alone.py")], capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stdout + out.stderr
    packages = [p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()]
    assert out.stdout.count("ok  ") == len(packages), out.stdout
