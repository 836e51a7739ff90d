"""The recipes that ship with tidal (integration/recipes/*.toml) pass every check a run makes before it
starts, through `tidal run --check`; a new recipe file is covered by being there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import msgspec
import pytest

from tidal.core.config import to_dict
from tidal.integration.cli import main
from tidal.integration.recipe import load_recipe, recipes_dir

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.toml"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A real Hugging Face folder (the check reads its files), built locally in under a second."""
    from tidal.rollout.tiny import TOOL_ALPHABET, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", alphabet=TOOL_ALPHABET, hidden=32,
                            layers=1, heads=2, kv_heads=1, intermediate=64)


def test_the_recipes_folder_is_the_one_tidal_ships():
    assert RECIPES and recipes_dir() == RECIPES[0].parent


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_passes_the_checks_of_a_run_and_prints_its_effective_config(
        recipe, model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--check", str(recipe), f'model="{model}"'])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "nothing was started" in err and not list(tmp_path.iterdir()), "--check made a run folder"
    assert json.loads(out) == json.loads(msgspec.json.encode(load_recipe(recipe, [f'model="{model}"'])))


def test_the_demo_runs_its_recipe_file(tmp_path):
    from tidal.integration.demo import TASKS, demo_config, demo_overrides

    for task, t in TASKS.items():
        cfg, _ = demo_config(tmp_path, [], task)
        recipe = load_recipe(recipes_dir() / t.recipe, [*demo_overrides(task), f'model="{tmp_path}"'])
        assert to_dict(cfg) == {**to_dict(recipe), "model": str(tmp_path / "model-sft"), "run_dir": str(tmp_path / "run")}


def tidal(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tidal")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "tidal.integration.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_run_check_prints_the_effective_config_and_refuses_a_bad_override_in_one_line(model, tmp_path):
    recipe = str(RECIPES[0])
    out = tidal("run", "--check", recipe, f'model="{model}"', "budget.versions=7", "sampling.temperature=0.5",
                cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["budget"]["versions"] == 7 and printed["sampling"]["temperature"] == 0.5
    assert not list(tmp_path.iterdir()), "--check made a run folder"
    out = tidal("run", "--check", recipe, f'model="{model}"', "learner.train.loss.name=ppoo", cwd=tmp_path)
    assert out.returncode == 2 and not out.stdout
    error = [line for line in out.stderr.splitlines() if line.startswith("tidal run: ")]
    assert len(error) == 1 and "learner.train.loss.name" in error[0] and "Did you mean 'ppo'" in error[0], out.stderr
    assert "--check" in tidal("run", "--help", cwd=tmp_path).stdout


@pytest.mark.slow
def test_the_wheel_ships_the_recipes_and_the_demo_reads_them_there(tmp_path):
    """Installed from its wheel, `tidal demo` has no checkout to read integration/recipes/ from."""
    uv = shutil.which("uv") or "uv"
    subprocess.run([uv, "build", "--quiet", "--wheel", "--package", "tidal", "--out-dir", str(tmp_path / "dist")],
                   check=True, capture_output=True, text=True, cwd=RECIPES[0].parents[2], timeout=300)
    (wheel,) = (tmp_path / "dist").glob("tidal-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    shipped = sorted(p.name for p in (tmp_path / "site" / "tidal" / "integration" / "recipes").glob("*.toml"))
    assert shipped == [p.name for p in RECIPES]
    code = ("from pathlib import Path; from tidal.integration.demo import demo_config; "
            "from tidal.integration.recipe import recipes_dir; "
            "print(recipes_dir()); print(demo_config(Path('out'), [], 'tools')[0].domains[0].env.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "site" / "tidal" / "integration" / "recipes"), "multiply"]
