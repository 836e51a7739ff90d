"""The monorepo's house rules, checked: PEP 420 namespace, one folder per package with its own
metadata, no sibling dependencies, and an import-linter contract and a type check that cover every package."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def _import_name(folder: Path) -> str:
    return folder.name.replace("-", "_")


def test_no_distribution_ships_tidal_init():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/**/src/tidal/__init__.py")]
    offenders += [str(p.relative_to(ROOT)) for p in ROOT.glob("integration/src/tidal/__init__.py")]
    assert not offenders, f"`tidal` is a PEP 420 namespace; remove {offenders}"


def test_every_package_has_its_own_metadata_and_layout():
    assert PACKAGES, "no packages found"
    for folder in PACKAGES:
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        assert meta["name"] == f"tidal-{folder.name}", folder
        assert meta["version"], folder
        for needed in ("README.md", "CHANGELOG.md", "tests"):
            assert (folder / needed).exists(), f"{folder.name} lacks {needed}"
        assert (folder / "src" / "tidal" / _import_name(folder) / "__init__.py").is_file(), folder


def test_siblings_do_not_depend_on_each_other():
    siblings = {f"tidal-{p.name}" for p in PACKAGES} - {"tidal-core"}
    for folder in PACKAGES:
        deps = tomllib.loads((folder / "pyproject.toml").read_text())["project"].get("dependencies", [])
        names = {d.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
        assert not (names & siblings), f"{folder.name} depends on sibling(s) {names & siblings}"


def test_import_contract_covers_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    modules = {f"tidal.{_import_name(p)}" for p in PACKAGES}
    assert modules | {"tidal.integration"} <= set(cfg["root_packages"])
    contracts = cfg["contracts"]
    core = [c for c in contracts if c["type"] == "forbidden" and c["source_modules"] == ["tidal.core"]]
    siblings = modules - {"tidal.core"}
    assert core and {"torch", *siblings} <= set(core[0]["forbidden_modules"])
    if len(siblings) >= 2:
        indep = [c for c in contracts if c["type"] == "independence"]
        assert indep and set(indep[0]["modules"]) == siblings, "independence contract must list every sibling"
    # and no package under packages/ may import the integration layer
    if siblings:
        up = [c for c in contracts if c["type"] == "forbidden" and "tidal.integration" in c["forbidden_modules"]]
        assert any(set(c["source_modules"]) >= modules for c in up), "every package must be barred from tidal.integration"


def test_import_cycles_are_forbidden_in_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    acyclic = [c for c in cfg["contracts"] if c["type"] == "acyclic_siblings"]
    assert acyclic, "an acyclic_siblings contract must forbid import cycles inside the packages"
    covered = {m for c in acyclic for m in c["ancestors"]}
    missing = set(cfg["root_packages"]) - covered
    assert not missing, f"import cycles are not forbidden in {sorted(missing)}: add them to the acyclic_siblings contract"


def test_type_check_covers_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    sources = {f"packages/{p.name}/src" for p in PACKAGES} | {"integration/src"}
    assert set(cfg["mypy_path"]) == sources, "mypy_path must list every package's src folder"
    assert set(cfg["files"]) == {f"{s}/tidal" for s in sources}, "mypy's files must be every package's tidal folder"
    assert "uv run --locked --all-packages mypy" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```bash\n")
    test_cmd = next(b.split("\n")[0] for b in blocks[1:] if "pytest" in b.split("\n")[0])
    # as it is, or timed by .ci/run's `tier NAME BUDGET COMMAND`
    runs = [line for line in ci.splitlines() if line == test_cmd or (line.startswith("tier ") and line.endswith(f" {test_cmd}"))]
    assert runs, f"CI must run the README's test command: {test_cmd}"


def test_scanning_the_plugins_imports_no_torch():
    """Every process loads every installed plugin module to build the registry: the buffer and the
    controller must not pay for (or depend on) torch because of it."""
    import subprocess
    import sys

    code = ("import sys; from tidal.core.plugins import Registry; r = Registry(); r.table();"
            "assert not r.failed, r.failed; assert 'torch' not in sys.modules, 'a plugin module imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
