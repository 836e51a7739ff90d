"""Tool-call parsers: the tags the tiny model writes and the Hermes/Qwen JSON format, round trips and
malformed calls."""

from __future__ import annotations

import pytest

from tidal.core.episodes import ToolCall, ToolResult
from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.core.toolparsers import JsonParser, TagParser


def test_tags_read_a_call_with_its_argument_and_raw_text() -> None:
    parser = TagParser()
    (call,) = parser.parse("let me see <calc>347*58</calc>")
    assert call == ToolCall(name="calculator", arguments={"expression": "347*58"}, raw="<calc>347*58</calc>")
    (code,) = parser.parse("<py>print(1)\nprint( 2 )</py>")
    assert code.name == "python" and code.arguments == {"code": "print(1)\nprint( 2 )"}
    assert parser.stop == ["</calc>", "</py>"]


def test_tags_several_calls_unknown_tags_and_plain_text() -> None:
    parser = TagParser()
    calls = parser.parse("<calc>1+1</calc> then <py>x</py><calc>2</calc>")
    assert [(c.name, *c.arguments.values()) for c in calls] == [("calculator", "1+1"), ("python", "x"), ("calculator", "2")]
    assert parser.parse("20126") == [] and parser.parse("<foo>1</foo> 3 > 2 < 4") == []
    assert parser.parse("</calc>") == []  # a stray closing tag is text, not a call


def test_tags_opened_but_unclosed_is_an_error() -> None:
    with pytest.raises(ValueError, match="<calc> opened but never closed"):
        TagParser().parse("<calc>347*58")
    with pytest.raises(ValueError, match="<py> opened"):
        TagParser().parse("<calc>1</calc><py>print(1)</calc>")


def test_tags_mapping_is_an_option_checked_when_built() -> None:
    parser = registry.build("tool_parser", "tags", {"tags": {"c": ["calculator", "expression"]}})
    assert parser.stop == ["</c>"] and parser.parse("<c>2*3</c>")[0].arguments == {"expression": "2*3"}
    assert parser.parse("<calc>2*3</calc>") == []
    for bad in ({"c": ["calculator"]}, {"result": ["calculator", "expression"]}, {"C<": ["a", "b"]}, {}):
        with pytest.raises(ConfigError):
            registry.build("tool_parser", "tags", {"tags": bad})


def test_tags_format_results_and_errors() -> None:
    parser, call = TagParser(), ToolCall(name="calculator")
    assert parser.format_result(call, ToolResult(content="20126")) == "<result>20126</result>"
    assert parser.format_result(call, ToolResult(content="division by zero", error="bad_arguments")) == \
        "<error>division by zero</error>"


def test_json_reads_hermes_calls_several_per_turn() -> None:
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    first, second = JsonParser().parse(text)
    assert first.name == "calculator" and first.arguments == {"expression": "2+2"}
    assert first.raw.startswith("<tool_call>") and first.raw.endswith("</tool_call>")
    assert second.name == "python" and second.arguments == {"code": "print(1)"}
    assert JsonParser().parse("The answer is 4.") == []
    assert JsonParser().parse('<tool_call>{"name": "now"}</tool_call>')[0].arguments == {}


@pytest.mark.parametrize(("text", "says"), [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not valid JSON"),
    ("<tool_call>calculator(2+2)</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name" string'),
    ('<tool_call>["calculator"]</tool_call>', '"name" string'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "never closed"),
])
def test_json_malformed_calls_are_errors(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        JsonParser().parse(text)


def test_json_results_are_the_content_and_its_stop_is_an_option() -> None:
    parser = registry.build("tool_parser", "json", {})
    assert parser.stop == [] and registry.build("tool_parser", "json", {"stop_after_call": True}).stop == ["</tool_call>"]
    call = ToolCall(name="python")
    assert parser.format_result(call, ToolResult(content="4\n")) == "4\n"
    assert parser.format_result(call, ToolResult(content="killed", error="timeout")) == "error (timeout): killed"
