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


def build_wheels(sources: list[str | Path], out: Path) -> list[str]:
    """Wheels of workspace members (by distribution name) and of project folders (paths) into `out`."""
    uv = shutil.which("uv") or "uv"
    for src in dict.fromkeys(sources):
        where = [str(src)] if isinstance(src, Path) else ["--package", src]
        run([uv, "build", "--quiet", "--wheel", *where, "--out-dir", str(out)], cwd=ROOT)
    return sorted(str(p) for p in out.glob("*.whl"))


def fresh_venv(venv: Path, wheels: list[str]) -> str:
    """An empty venv on this Python with `wheels` (and their PyPI dependencies) installed; its python."""
    uv = shutil.which("uv") or "uv"
    run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    py = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--quiet", "--python", py, *wheels])
    return py


def tidal_dists(py: str) -> list[str]:
    """The tidal* distributions installed for interpreter `py`."""
    uv = shutil.which("uv") or "uv"
    installed = run([uv, "pip", "list", "--python", py, "--format", "freeze"]).stdout
    return sorted(line.split("==")[0] for line in installed.splitlines() if line.startswith("tidal"))


def run_readme(readme: Path, py: str, work: Path, name: str) -> int:
    """Run every ```python block of `readme` with `py` in `work`; the number of blocks (at least one)."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    if not blocks:
        raise SystemExit(f"{name}: README.md has no ```python example")
    for i, code in enumerate(blocks):
        script = work / f"readme_{i}.py"
        script.write_text(code)
        out = subprocess.run([py, str(script)], capture_output=True, text=True, timeout=600, cwd=work)
        if out.returncode != 0:
            raise SystemExit(f"{name}: README example {i} failed in a fresh venv:\n{out.stdout}\n{out.stderr}")
    return len(blocks)


def check(folder: Path, work: Path) -> None:
    name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
    wheels = build_wheels(["tidal-core", name], work / name / "dist")
    py = fresh_venv(work / name / "venv", wheels)
    found = tidal_dists(py)
    expected = sorted({"tidal-core", name})
    if found != expected:
        raise SystemExit(f"{name}: installing it alone pulled in {found}, expected only {expected}")
    n = run_readme(folder / "README.md", py, work / name, name)
    print(f"ok  {name}: installs alone ({', '.join(found)}), {n} README example(s) ran")


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
