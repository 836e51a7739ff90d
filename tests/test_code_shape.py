"""Code shape, checked over every package's source: no module longer than 600 lines, no function longer
than a screen, and an import inside a function says why it is not at the top of its module (heavy and
optional, or breaking a cycle)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600

MODULES_NOT_YET_SPLIT: tuple[str, ...] = ()

IMPORTS_NOT_YET_CHECKED: tuple[str, ...] = ()
IMPORTED_MODULES_NOT_YET_CHECKED: tuple[str, ...] = ()


def _sources() -> Iterator[Path]:
    for src in sorted([*ROOT.glob("packages/*/src"), ROOT / "integration" / "src"]):
        yield from sorted(src.rglob("*.py"))


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_no_module_is_longer_than_600_lines():
    too_long = []
    for path in _sources():
        name = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and name not in MODULES_NOT_YET_SPLIT:
            too_long.append(f"{name} ({lines} lines)")
    assert not too_long, (f"modules over {MAX_MODULE_LINES} lines; split each by subject into a sibling module "
                          "with an obvious name:\n" + "\n".join(too_long))


def test_no_function_is_longer_than_60_lines():
    too_long = []
    for path in _sources():
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            lines = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
            if lines > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({lines} lines)")
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines; split them into named pieces:\n"
                          + "\n".join(too_long))


def _unexplained_imports(path: Path) -> Iterator[str]:
    """Imports inside a function with no comment on their line nor on the line above the run of
    imports they belong to (one comment may explain a run, blank lines between its groups included)."""
    text = path.read_text()
    lines = text.splitlines()
    nested = {n for fn in _functions(ast.parse(text, str(path))) for n in ast.walk(fn)}
    imports = sorted((n for n in nested if isinstance(n, ast.Import | ast.ImportFrom)), key=lambda n: n.lineno)
    import_lines = {i for n in imports for i in range(n.lineno, n.end_lineno + 1)}  # type: ignore[operator]
    for node in imports:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(IMPORTED_MODULES_NOT_YET_CHECKED):
            continue
        own = range(node.lineno, node.end_lineno + 1)  # type: ignore[operator]
        if any("#" in lines[i - 1] for i in own):
            continue
        above = node.lineno - 1
        while above >= 1 and (above in import_lines or not lines[above - 1].strip()) and "#" not in lines[above - 1]:
            above -= 1
        if above >= 1 and lines[above - 1].lstrip().startswith("#"):
            continue
        yield f"{path.relative_to(ROOT)}:{node.lineno} {lines[node.lineno - 1].strip()}"


def test_imports_inside_functions_say_why_they_are_not_at_the_top():
    unexplained = [
        found
        for path in _sources()
        if not str(path.relative_to(ROOT)).startswith(IMPORTS_NOT_YET_CHECKED)
        for found in _unexplained_imports(path)
    ]
    assert not unexplained, (
        "imports inside functions belong at the top of the module, unless they are heavy and optional or "
        "break an unavoidable cycle; then a comment on the line or the line above says which:\n"
        + "\n".join(unexplained)
    )
