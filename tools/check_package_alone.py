"""Check that a package installs alone and its README example runs, in a fresh virtual environment.

    uv run python tools/check_package_alone.py [PACKAGE ...]      # default: every package under packages/

For each package: build its wheel (and tidal-core's, the one sibling every package may need), create an
empty venv, install the wheels with their PyPI dependencies, run every ```python block of the package
README in that venv, and check that no other tidal-* distribution was installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def check(folder: Path, work: Path) -> None:
    name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
    dist = work / name / "dist"
    venv = work / name / "venv"
    uv = shutil.which("uv") or "uv"
    wheels = []
    for pkg in dict.fromkeys(["tidal-core", name]):
        run([uv, "build", "--quiet", "--wheel", "--package", pkg, "--out-dir", str(dist)], cwd=ROOT)
    wheels = sorted(str(p) for p in dist.glob("*.whl"))
    run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    py = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--quiet", "--python", py, *wheels])
    installed = run([uv, "pip", "list", "--python", py, "--format", "freeze"]).stdout
    tidal_dists = sorted(line.split("==")[0] for line in installed.splitlines() if line.startswith("tidal"))
    expected = sorted({"tidal-core", name})
    if tidal_dists != expected:
        raise SystemExit(f"{name}: installing it alone pulled in {tidal_dists}, expected only {expected}")
    blocks = re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)
    if not blocks:
        raise SystemExit(f"{name}: README.md has no ```python example")
    for i, code in enumerate(blocks):
        script = work / name / f"readme_{i}.py"
        script.write_text(code)
        out = subprocess.run([py, str(script)], capture_output=True, text=True, timeout=600, cwd=work)
        if out.returncode != 0:
            raise SystemExit(f"{name}: README example {i} failed in a fresh venv:\n{out.stdout}\n{out.stderr}")
    print(f"ok  {name}: installs alone ({', '.join(tidal_dists)}), {len(blocks)} README example(s) ran")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", help="folder names under packages/ (default: all)")
    args = ap.parse_args(argv)
    folders = [ROOT / "packages" / p for p in args.packages] or sorted(
        p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()
    )
    with tempfile.TemporaryDirectory(prefix="tidal-alone-") as tmp:
        for folder in folders:
            check(folder, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
