"""docs/recipe.md, the recipe field reference, is what tools/recipe_reference.py writes from the config
structs: a field added, renamed or recommented without rerunning the tool fails here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).parents[1]
TOOL = ROOT / "tools" / "recipe_reference.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("recipe_reference", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_recipe_md_is_up_to_date():
    out = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr + "\nrun: uv run python tools/recipe_reference.py"


def test_every_section_and_field_of_the_recipe_is_in_the_reference():
    tool = load_tool()
    from tidal.integration.recipe import RunConfig

    page = (ROOT / "docs" / "recipe.md").read_text()
    for path, cls in tool.sections(RunConfig):
        for f in msgspec.structs.fields(cls):
            assert f"- `{f.name}`: " in page, f"{path}.{f.name}"
    assert '- `run_dir`: `str` = `""`. "" = runs/<name>-<date>-<time>' in page
    assert "## `rollout.episodes`" in page and "## `[[domains]]`" in page and "## `learner.backend.options.optim`" in page


def test_a_stale_reference_is_refused_with_the_command_that_rewrites_it(tmp_path, monkeypatch, capsys):
    tool = load_tool()
    stale = tmp_path / "recipe.md"
    stale.write_text(tool.render().replace("check_envs", "check_env"))
    monkeypatch.setattr(tool, "OUT", stale)
    assert tool.main(["--check"]) == 1
    assert "tools/recipe_reference.py" in capsys.readouterr().err
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0


def test_a_fields_comments_above_beside_and_below_are_all_kept():
    tool = load_tool()
    from tidal.core.config import ConfigStruct

    class Example(ConfigStruct):
        # first line above,
        # second line above
        a: int = 1  # beside
        b: str = "x"
        """below, as a docstring"""
        c: float = 0.5

    comments = tool.field_comments(Example)
    assert comments == {"a": "first line above, second line above beside", "b": "below, as a docstring", "c": ""}
