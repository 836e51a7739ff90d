"""Write docs/recipe.md, the reference of every recipe field, from the config structs themselves: each
section and field with its type, its default and the comment beside it in the source.

    uv run python tools/recipe_reference.py           # rewrite docs/recipe.md
    uv run python tools/recipe_reference.py --check   # exit 1 when docs/recipe.md is stale (CI, tests)

The comments are the ones a field carries in its struct (a trailing `# ...`, the comment lines just above
it, or a string just below it), so the reference changes where the field does and cannot drift from it.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Collection
from pathlib import Path

import msgspec

OUT = Path(__file__).resolve().parents[1] / "docs" / "recipe.md"

HEADER = """# Recipe reference

Every field of a `tidal run` recipe, section by section: its type, its default, and what it does. A
recipe is one TOML file; any field is also an override on the command line by its dotted name
(`tidal run recipe.toml rollout.episodes.step_timeout_s=5`). A section written `[[domains]]` is a list of
tables; `<name>` stands for a key you choose.

Written by `tools/recipe_reference.py` from the config structs' own comments; do not edit by hand (a test,
tests/test_recipe_reference.py, fails when this page and the structs disagree: rerun the tool).

A field typed `PluginRef` chooses a plugin by name and passes it options:
`{ name = "grpo", options = { eps = 1e-6 } }`. `tidal plugins KIND` lists the names, and each plugin's
options are in docs/plugins.md or its own documentation. Every plugin choice has this shape; the train
backend's (`learner.backend`, a `BackendChoice`) has typed options, listed below. A list of them
(`rollout.weight_transport`) names each plugin once.
"""


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment in `cls`'s source (and its bases'): comment lines right above the field,
    its trailing comment, and a string statement right below it, in that order."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is msgspec.Struct or not issubclass(klass, msgspec.Struct) or klass.__module__ == "msgspec":
            continue
        out.update(_own_comments(klass))
    return out


def _own_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for i, node in enumerate(body.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:  # a block of comment-only lines
            above.insert(0, comments[line])
            line -= 1
        end = node.end_lineno or node.lineno
        trailing = [comments[n] for n in range(node.lineno, end + 1) if n in comments and n in code_lines]
        below = []
        after = body.body[i + 1] if i + 1 < len(body.body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            below.append(inspect.cleandoc(after.value.value))
        text = " ".join(above + trailing + below)
        out[node.target.id] = " ".join(text.split())
    return out


def annotation(cls: type, name: str) -> str:
    """The field's type as written in the source (``Literal["auto", "rich"]``, ``PluginRef | None``)."""
    for klass in cls.__mro__:
        written = inspect.get_annotations(klass).get(name)
        if written is not None:
            return written if isinstance(written, str) else getattr(written, "__name__", repr(written))
    return "?"


def toml(value: object) -> str:
    """`value` as a recipe writes it."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    return repr(value)


def default(f: msgspec.structs.FieldInfo) -> str:
    if f.default is not msgspec.NODEFAULT:
        return toml(f.default)
    if f.default_factory is not msgspec.NODEFAULT:
        return toml(f.default_factory())
    return "(required)"


def nested(typ: object) -> tuple[type, str] | None:
    """(the section struct, how its path reads) when a field of type `typ` is a section of its own:
    a struct (``.x``), an optional struct, a list of structs (``x[]``) or a table of them (``x.<name>``)."""
    from tidal.core.config import PluginRef

    def section(t: object) -> bool:
        return isinstance(t, type) and issubclass(t, msgspec.Struct) and t is not PluginRef

    if section(typ):
        return typ, ""  # type: ignore[return-value]
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and section(inner[0]):
            return inner[0], ""
    if origin is list and args and section(args[0]):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and section(args[1]):
        return args[1], ".<name>"
    return None


def sections(cls: type, path: str = "", skip: Collection[str] = ()) -> list[tuple[str, type]]:
    """(dotted path, struct) for `cls` and every section below it, depth first in field order; not below
    the fields in `skip` (those the run sets: `rollout.domains` is the top-level `[[domains]]`)."""
    out = [(path, cls)]
    for f in msgspec.structs.fields(cls):
        sub = nested(f.type)
        dotted = f"{path}.{f.name}" if path else f.name
        if sub is not None and dotted not in skip:
            out += sections(sub[0], dotted + sub[1], skip)
    return out


def set_by_run() -> dict[str, str]:
    """field path -> where the run takes its value from: fields a recipe leaves alone."""
    from tidal.integration.recipe import RunConfig, set_by_the_run

    return {name: source[1] for name, _, _, source in set_by_the_run(RunConfig())}


def render() -> str:
    from tidal.integration.recipe import RunConfig

    filled = set_by_run()
    parts = [HEADER]
    for path, cls in sections(RunConfig, skip=filled):
        title = f"`{path}`" if path else "Top level"
        if path.endswith("[]"):
            title = f"`[[{path[:-2]}]]`"
        parts.append(f"\n## {title}\n")
        doc = cls.__doc__ if cls.__doc__ and cls.__doc__ is not msgspec.Struct.__doc__ else ""
        if doc and not doc.startswith("Base of config sections"):
            parts.append(inspect.cleandoc(doc) + "\n")
        comments = field_comments(cls)
        for f in msgspec.structs.fields(cls):
            sub = nested(f.type)
            dotted = f"{path}.{f.name}" if path else f.name
            if sub is not None and dotted not in filled:
                shown = f"[[{dotted}]]" if sub[1] == "[]" else dotted + sub[1]
                line = f"- `{f.name}`: `{annotation(cls, f.name)}`, the section `{shown}` below"
            else:
                line = f"- `{f.name}`: `{annotation(cls, f.name)}` = `{default(f)}`"
            notes = [comments.get(f.name, "")]
            if dotted in filled:
                notes.append(f"Set by the run ({filled[dotted]}): leave it out.")
            parts.append(line + "".join(f". {_sentence(n)}" for n in notes if n) + "\n")
    return "".join(parts)


def _sentence(text: str) -> str:
    """A comment as the sentence after a field's type: its first letter as written, no doubled stop."""
    return text[:-1] if text.endswith(".") and not text.endswith("...") else text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/recipe.md is stale; write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: the config structs changed. Rewrite it with: uv run python tools/recipe_reference.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
