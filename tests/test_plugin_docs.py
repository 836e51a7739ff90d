"""docs/plugins.md stays true: every Python example in it runs, each as a module of its own that
registers its plugin, builds it through the registry and uses it."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOC = Path(__file__).parents[1] / "docs" / "plugins.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_an_example_for_every_plugin_kind():
    from tidal.core.plugins import KINDS

    examples = DOC.read_text().split("## One example of each kind", 1)[1].split("\n## ", 1)[0]
    headings = set(re.findall(r"^### (\w+)", examples, flags=re.M))
    assert headings == set(KINDS), sorted(set(KINDS) ^ headings)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_example_runs(index, capsys):
    name = f"acme_docs_example_{index}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(BLOCKS[index], f"{DOC}:example {index}", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    assert capsys.readouterr().out.strip(), "each example prints what its plugin did"
