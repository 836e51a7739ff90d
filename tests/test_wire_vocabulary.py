"""The wire vocabulary is spelt once, in `tidal.core.protocol`: no package writes a topic name or an
`Ack.kind` as a string literal, builds or parses a trajectory id by hand, or imports the test helpers of
`tidal.core.testing` outside tests and tools.

The check reads each source file's syntax tree (not its text), so a comment or a docstring that mentions
"metrics" is fine, and what it flags is exactly a literal on the wire's path:
- ``Ack(kind="...")`` and ``x.kind == "..."`` with an ack kind;
- a topic as the first argument of ``publish`` / ``_publish`` / ``wait_for_subscriber``, or in ``topics=[...]``;
- f-strings of the form ``f"{a}:{b}"`` (trajectory ids: `trajectory_id`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from tidal.core.protocol import TOPIC_METRICS, TOPIC_WEIGHTS, AckKind

ROOT = Path(__file__).parents[1]
SOURCES = sorted(p for p in [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("integration/src/**/*.py")]
                 if p.name != "testing.py" or "core" not in p.parts)
PROTOCOL = ROOT / "packages/core/src/tidal/core/protocol.py"
ACK_KINDS = set(get_args(AckKind))
TOPICS = {TOPIC_METRICS, TOPIC_WEIGHTS}
TOPIC_CALLS = {"publish", "_publish", "wait_for_subscriber"}


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_line_number(value: ast.expr) -> bool:
    expr = value.value if isinstance(value, ast.FormattedValue) else value
    name = expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", "")
    return name in ("line", "lineno", "tb_lineno", "f_lineno")


def _findings(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "Ack":
                for kw in node.keywords:
                    if kw.arg == "kind" and _literal(kw.value) is not None:
                        out.append(f"{where}: Ack(kind={_literal(kw.value)!r})")
            if name in TOPIC_CALLS and node.args and _literal(node.args[0]) in TOPICS:
                out.append(f"{where}: {name}({_literal(node.args[0])!r})")
            for kw in node.keywords:
                if kw.arg == "topics" and isinstance(kw.value, (ast.List, ast.Tuple)):
                    out += [f"{where}: topics=[{_literal(e)!r}]" for e in kw.value.elts if _literal(e) in TOPICS]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
            out += [f"{where}: .kind == {_literal(c)!r}" for c in node.comparators if _literal(c) in ACK_KINDS]
        elif isinstance(node, ast.JoinedStr) and [type(v) for v in node.values] == [
                ast.FormattedValue, ast.Constant, ast.FormattedValue] and _literal(node.values[1]) == ":" \
                and not _is_line_number(node.values[2]):  # a source location, path:line, is no id
            out.append(f"{where}: an id built as f'{{a}}:{{b}}' (tidal.core.protocol.trajectory_id)")
    return out


def test_no_topic_or_ack_kind_literal_outside_the_protocol_module():
    assert len(SOURCES) > 50, "the scan found too few source files: has the layout changed?"
    found = [f for p in SOURCES if p != PROTOCOL for f in _findings(p)]
    assert not found, "spell these with tidal.core.protocol's names:\n" + "\n".join(found)


def test_the_scan_sees_what_it_forbids():
    """Negative control: the protocol module itself builds ids with f-strings, and a literal ack kind
    or topic written the old way is caught."""
    assert _findings(PROTOCOL), "the scan should flag protocol.py's own trajectory_id f-string"
    probe = ROOT / "tests" / "_vocabulary_probe.py"
    probe.write_text('Ack(kind="batch", ids=[])\npub.publish("metrics", m)\nif a.kind == "group": pass\n'
                     'sub(e, topics=["weights"])\n')
    try:
        assert len(_findings(probe)) == 4, _findings(probe)
    finally:
        probe.unlink()


def test_no_production_module_imports_the_test_helpers():
    found = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.module == "tidal.core.testing":
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name == "tidal.core.testing" for a in node.names):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not found, "production code imports tidal.core.testing (test helpers):\n" + "\n".join(found)
