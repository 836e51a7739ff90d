"""The `tidal` command, run as a user runs it: a real process, a real plugin installed on its path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tidal.core.protocol import PROTOCOL_VERSION


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
    recipe.write_text(f'model = "{tmp_path}"\n[learner]\nbackend_options = {{ optim = {{ lr = "fast" }} }}\n')
    out = tidal("run", str(recipe))
    assert out.returncode == 2 and "learner.backend_options.optim.lr" in out.stderr
    out = tidal("run", str(recipe), "learner.backend_options.optim.lr=1e-4", "domains=[{env=\"algebra\"}]")
    assert out.returncode == 2 and "algebra" in out.stderr and "arithmetic" in out.stderr
    out = tidal("run", str(recipe), 'model="/nowhere"', "learner.backend_options.optim.lr=1e-4")
    assert out.returncode == 2 and "/nowhere" in out.stderr


def test_report_and_status_name_a_folder_that_is_not_a_run(tmp_path):
    for command in ("report", "status"):
        out = tidal(command, str(tmp_path))
        assert out.returncode == 2 and "metrics.jsonl" in out.stderr
