"""docs/architecture.md stays true to the tree: every repository path it names exists, and every
`path::Name` / `path::Class.method` it names is defined there (read with ast, nothing imported).

What counts as a reference (inside backticks, no spaces):
- `path/to/file.py::Name` or `path/to/file.py::Class.method`: the file exists and defines `Name` at top
  level (a class, a function or an assigned name), or `Class` at top level with `method` in its body;
- `some/path.py`, `some/doc.md`, `some/file.toml`, `some/script.sh`, or a folder written with a trailing
  `/` (`packages/core/`): the path exists, relative to the repository root;
- `Class.method` (a short form): where a full reference on the page locates `Class`, that class has `method`;
- in a row of the package table (its first cell a backticked folder such as `packages/core/`), a bare file
  name (`service.py`) is a file somewhere under that folder;
- and a relative Markdown link `[text](target)`: the target exists, relative to docs/.
A backticked text with a placeholder (`<`, `*`, `{`) or a URL (`://`) is not a path; a `../` path points
outside the repository and is not checked.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

CODE = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FILE_SUFFIXES = (".py", ".md", ".toml", ".sh")
SHORT = re.compile(r"[A-Z][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")
TABLE_ROW = re.compile(r"^\| `([^`]+/)` \|(.*)$", re.MULTILINE)


def references(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(paths, (path, qualified name) pairs) the text names in backticks, in order, without repeats."""
    paths: list[str] = []
    names: list[tuple[str, str]] = []
    for token in CODE.findall(text):
        if any(c in token for c in "<*{") or "://" in token or token.startswith("../"):
            continue
        if "::" in token:
            path, _, name = token.partition("::")
            if (path, name) not in names:
                names.append((path, name))
            if path not in paths:
                paths.append(path)
        elif "/" in token and (token.endswith(FILE_SUFFIXES) or token.endswith("/")) and token not in paths:
            paths.append(token)
    return paths, names


@cache
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=path)


def _top_level(module: ast.Module) -> dict[str, ast.stmt]:
    found: dict[str, ast.stmt] = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
    return found


def defined(path: str, name: str) -> bool:
    """Whether `path` (a Python file under ROOT) defines `name` ("Name" or "Class.method")."""
    top = _top_level(_tree(path))
    head, _, member = name.partition(".")
    node = top.get(head)
    if node is None:
        return False
    if not member:
        return True
    if not isinstance(node, ast.ClassDef) or "." in member:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member for n in node.body)


def where(text: str, token: str) -> str:
    """`token` with the doc's line numbers where it is written in backticks (alone, or before `::`)."""
    lines = [str(i) for i, line in enumerate(text.splitlines(), 1) if f"`{token}`" in line or f"`{token}::" in line]
    return f"{token} (line {', '.join(lines)})" if lines else token


def test_the_doc_names_references():
    paths, names = references(DOC.read_text(encoding="utf-8"))
    assert len(paths) > 40 and len(names) > 60, "the reference extraction found too little: is the format still `path::Name`?"


def test_every_path_the_doc_names_exists():
    text = DOC.read_text(encoding="utf-8")
    paths, _ = references(text)
    missing = [where(text, p) for p in paths if not (ROOT / p).exists() or (p.endswith("/") and not (ROOT / p).is_dir())]
    assert not missing, "docs/architecture.md names paths that do not exist:\n  " + "\n  ".join(missing)


def test_every_name_the_doc_names_is_defined_where_it_says():
    text = DOC.read_text(encoding="utf-8")
    _, names = references(text)
    wrong = []
    for path, name in names:
        if not path.endswith(".py") or not (ROOT / path).is_file():
            wrong.append(f"{where(text, f'{path}::{name}')}: no such Python file")
        elif not defined(path, name):
            wrong.append(f"{where(text, f'{path}::{name}')}: not defined in that file")
    assert not wrong, "docs/architecture.md names definitions that are not there:\n  " + "\n  ".join(wrong)


def short_forms(text: str) -> list[tuple[str, str]]:
    """(path, "Class.method") for each backticked `Class.method` whose class a full reference locates."""
    _, names = references(text)
    where: dict[str, list[str]] = {}
    for path, name in names:
        head = name.partition(".")[0]
        if path.endswith(".py") and (ROOT / path).is_file() and isinstance(_top_level(_tree(path)).get(head), ast.ClassDef):
            where.setdefault(head, []).append(path)
    found: list[tuple[str, str]] = []
    for token in CODE.findall(text):
        if SHORT.fullmatch(token) and token.partition(".")[0] in where:
            found.extend((path, token) for path in dict.fromkeys(where[token.partition(".")[0]]))
    return found


def test_every_short_form_names_a_method_of_its_class():
    text = DOC.read_text(encoding="utf-8")
    found = short_forms(text)
    by_token: dict[str, bool] = {}
    for path, token in found:  # a class name defined in several referenced files: one of them will do
        by_token[token] = by_token.get(token, False) or defined(path, token)
    wrong = sorted(where(text, t) for t, ok in by_token.items() if not ok)
    assert not wrong, "docs/architecture.md names methods its classes do not have:\n  " + "\n  ".join(wrong)


def test_every_module_of_the_package_table_exists():
    missing = []
    for folder, cells in TABLE_ROW.findall(DOC.read_text(encoding="utf-8")):
        for token in CODE.findall(cells):
            if token.endswith(".py") and "/" not in token and "*" not in token:
                if not any((ROOT / folder).rglob(token)):
                    missing.append(f"{token} (under {folder})")
    assert not missing, "docs/architecture.md's package table names modules that do not exist:\n  " + "\n  ".join(missing)


def test_every_relative_link_of_the_doc_resolves():
    targets = [t.split("#", 1)[0] for t in LINK.findall(DOC.read_text(encoding="utf-8"))
               if "://" not in t and not t.startswith(("#", "mailto:"))]
    missing = [t for t in targets if t and not (DOC.parent / t).exists()]
    assert not missing, "docs/architecture.md links to files that do not exist:\n  " + "\n  ".join(missing)


def test_the_checker_itself():
    """The extraction and the ast check catch what they are meant to (on this file's own tree)."""
    text = ("`tests/test_architecture_doc.py::defined` `tests/test_architecture_doc.py::nowhere` `docs/` "
            "`RUN_DIR/roles/*.json` `ipc://x/y.py` `../shared/DESIGN.md` `a/b.py::C.m` `plain words`")
    paths, names = references(text)
    assert paths == ["tests/test_architecture_doc.py", "docs/", "a/b.py"]
    assert names == [("tests/test_architecture_doc.py", "defined"), ("tests/test_architecture_doc.py", "nowhere"),
                     ("a/b.py", "C.m")]
    this = "tests/test_architecture_doc.py"
    assert defined(this, "defined") and defined(this, "ROOT")
    assert not defined(this, "nowhere") and not defined(this, "defined.x")
    core = "packages/core/src/tidal/core/plugins.py"
    shorts = short_forms(f"`{core}::Registry` `Registry.build` `Registry.nowhere` `Other.build`")
    assert shorts == [(core, "Registry.build"), (core, "Registry.nowhere")]
    assert defined(core, "Registry.build") and not defined(core, "Registry.nowhere")
