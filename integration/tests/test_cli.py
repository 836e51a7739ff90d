"""The `tidal` command, run as a user runs it: a real process, a real plugin installed on its path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tidal.core.protocol import PROTOCOL_VERSION

RECIPES = Path(__file__).parents[1] / "recipes"


def tidal(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tidal")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "tidal.integration.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_help_names_the_commands():
    out = tidal("--help")
    assert out.returncode == 0
    assert "plugins" in out.stdout and "version" in out.stdout


def test_version_lists_protocol_and_packages():
    out = tidal("version")
    assert out.returncode == 0
    assert "Tidal wire protocol {}.{}".format(*PROTOCOL_VERSION) in out.stdout and "tidal-core 0.1.0" in out.stdout


def test_plugins_lists_a_third_party_plugin(tmp_path):
    (tmp_path / "acme_tidal.py").write_text(textwrap.dedent("""
        from tidal.core.plugins import hookimpl

        @hookimpl
        def tidal_rewards():
            return {"acme-exact": lambda task, completion: 1.0}
    """))
    info = tmp_path / "acme_tidal-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tidal\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tidal]\nacme = acme_tidal\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tidal("plugins", "reward", env=env)
    assert out.returncode == 0, out.stderr
    assert "acme-exact" in out.stdout and "from acme" in out.stdout


@pytest.mark.parametrize("kind", ["bogus"])
def test_plugins_rejects_unknown_kind(kind):
    out = tidal("plugins", kind)
    assert out.returncode == 2 and "kinds are: engine" in out.stderr


def test_help_of_run_and_demo_explains_them():
    out = tidal("--help")
    for command in ("run", "demo", "status", "report"):
        assert command in out.stdout
    run_help = tidal("run", "--help").stdout
    assert "RECIPE" in run_help.upper() and "--nproc" in run_help and "dotted" in run_help
    assert "SFT" in tidal("demo", "--help").stdout


def test_run_names_the_bad_field_of_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('model = "/nowhere"\ngroup_sise = 4\n')
    out = tidal("run", str(recipe))
    assert out.returncode == 2 and "group_sise" in out.stderr and "group_size" in out.stderr
    recipe.write_text(f'model = "{tmp_path}"\n[learner]\nbackend = {{ options = {{ optim = {{ lr = "fast" }} }} }}\n')
    out = tidal("run", str(recipe))
    assert out.returncode == 2 and "learner.backend.options.optim.lr" in out.stderr
    out = tidal("run", str(recipe), "learner.backend.options.optim.lr=1e-4", "domains=[{env={name=\"algebra\"}}]")
    assert out.returncode == 2 and "algebra" in out.stderr and "arithmetic" in out.stderr
    out = tidal("run", str(recipe), 'model="/nowhere"', "learner.backend.options.optim.lr=1e-4")
    assert out.returncode == 2 and "/nowhere" in out.stderr


def test_report_and_status_name_a_folder_that_is_not_a_run(tmp_path):
    for command in ("report", "status"):
        out = tidal(command, str(tmp_path))
        assert out.returncode == 2 and "metrics.jsonl" in out.stderr


def _refused(tmp_path, monkeypatch, capsys, *args: str) -> str:
    """`tidal run` in tmp_path (in this process: no start-up cost); it must refuse with exit code 2 and
    leave tmp_path as it was: no run folder made (runs/...), so no role was started either (the roles'
    configs and logs live in it). Its stderr."""
    from tidal.integration.cli import main

    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["run", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused run made a run folder"
    return err


@pytest.mark.parametrize(("overrides", "needles"), [
    (["learner.backend.options.optim.lr=-1e-5"], ["learner.backend.options.optim.lr", "-1e-05", ">= 0"]),
    (["budget.minutes=-1"], ["budget.minutes", ">= 0", "got -1"]),
    (["eval.every=-5"], ["eval.every", ">= 0", "got -5"]),
    (["learner.keep_checkpoints=0"], ["learner.keep_checkpoints", ">= 1", "got 0"]),
    (['mode="asynch"'], ["mode", "'asynch'", "'async', 'sync'", "did you mean 'async'"]),
])
def test_run_refuses_a_mistake_before_anything_starts(tmp_path, monkeypatch, capsys, overrides, needles):
    model = tmp_path / "model"
    model.mkdir()
    err = _refused(tmp_path, monkeypatch, capsys, str(RECIPES / "arithmetic.toml"), f'model="{model}"', *overrides)
    assert err.startswith("tidal run: ") and err.count("\n") == 1, err  # one line
    for needle in needles:
        assert needle in err, err


def test_run_refuses_a_folder_that_holds_no_model_naming_what_is_missing(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("weights go here")
    err = _refused(tmp_path, monkeypatch, capsys, str(RECIPES / "arithmetic.toml"), f'model="{folder}"')
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(folder) in err and "config.json" in err and "safetensors" in err and "tokenizer" in err, err
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    err = _refused(tmp_path, monkeypatch, capsys, str(RECIPES / "arithmetic.toml"), f'model="{folder}"')
    assert "no weights" in err and "config.json" not in err and "tokenizer" not in err, err


def test_help_says_where_the_run_folder_goes_and_describes_status_report_export():
    run_help = tidal("run", "--help").stdout
    assert "runs/NAME-DATE-TIME" in run_help and "run_dir" in run_help
    for command in ("status", "report", "export", "samples"):
        text = tidal(command, "--help").stdout
        assert "usage:" in text and len(text.split("\n\n")[1]) > 80, text  # a description, not just the usage
    demo = tidal("demo", "--help").stdout
    readme = (RECIPES.parents[1] / "README.md").read_text()
    for claim in ("about 1 minute", "1 on 2 cores"):
        assert claim in " ".join(demo.split()) and claim in " ".join(readme.split()), claim


def test_overrides_may_follow_an_option_and_a_stray_word_is_still_refused(tmp_path):
    """`tidal run R.toml --nproc 2 workers=3` (as the README's cluster line has it) takes workers=3; a word
    that is neither an option nor key=value is refused by name."""
    from tidal.rollout.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    out = tidal("run", "--check", str(RECIPES / "arithmetic.toml"), f'model="{model}"', "--nproc", "2", "workers=3")
    assert out.returncode == 0, out.stderr
    assert '"workers": 3' in out.stdout, out.stdout[-2000:]
    bad = tidal("run", "--check", str(RECIPES / "arithmetic.toml"), f'model="{model}"', "--nproc", "2", "workers")
    assert bad.returncode == 2 and "unrecognized arguments: workers" in bad.stderr, bad.stderr
