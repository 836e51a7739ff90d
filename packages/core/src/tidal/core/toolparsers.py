"""Tool-call parsers (plugin kind ``tool_parser``): where the calls are in the model's text, and how a
result is shown back.

- `TagParser` (``tags``): ``<calc>347*58</calc>`` calls the calculator with ``expression="347*58"``; a
  format a character-level model can learn (the tiny tokenizer needs `TOOL_ALPHABET` for ``<>_``). Each
  tag names a tool and the one argument its text fills. The engine stops at a closing tag, so a turn
  holds one call; results come back as ``<result>20126</result>`` or ``<error>...</error>``.
- `JsonParser` (``json``): the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, any number in a turn (the turn ends at the chat template's end of turn); a result is
  its content, which the chat template wraps in a tool message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from tidal.core.episodes import ToolCall, ToolResult

DEFAULT_TAGS = {"calc": ["calculator", "expression"], "py": ["python", "code"]}
_TAG_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class TagParser:
    """``<tag>argument</tag>`` calls; `tags` maps each tag to ``[tool name, argument name]``."""

    def __init__(self, tags: dict[str, list[str]] | None = None) -> None:
        tags = DEFAULT_TAGS if tags is None else tags
        if not tags:
            raise ValueError("tags needs at least one tag: {tag: [tool name, argument name]}")
        self.tags: dict[str, tuple[str, str]] = {}
        for tag, target in tags.items():
            if not _TAG_NAME.match(tag) or tag in ("result", "error"):
                raise ValueError(f"tag {tag!r} must be lowercase letters, digits and _, and not result or error")
            if len(target) != 2 or not all(isinstance(x, str) and x for x in target):
                raise ValueError(f"tag {tag!r} must map to [tool name, argument name], got {target!r}")
            self.tags[tag] = (target[0], target[1])
        names = "|".join(re.escape(t) for t in self.tags)
        self._open = re.compile(f"<({names})>")
        self.stop: Sequence[str] = [f"</{tag}>" for tag in self.tags]

    def parse(self, text: str) -> list[ToolCall]:
        calls, at = [], 0
        while (opened := self._open.search(text, at)) is not None:
            tag = opened.group(1)
            close = text.find(f"</{tag}>", opened.end())
            if close < 0:
                raise ValueError(f"<{tag}> opened but never closed: write <{tag}>...</{tag}>")
            tool, argument = self.tags[tag]
            end = close + len(tag) + 3
            calls.append(ToolCall(name=tool, arguments={argument: text[opened.end():close]}, raw=text[opened.start():end]))
            at = end
        return calls

    def format_result(self, call: ToolCall, result: ToolResult) -> str:
        return f"<error>{result.content}</error>" if result.error else f"<result>{result.content}</result>"


class JsonParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls, several per turn allowed.
    `arguments` may also be a JSON string holding the object (as OpenAI-style models write it)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, stop_after_call: bool = False) -> None:
        # a turn usually ends at the template's end of turn; stopping at the first call allows only one
        self.stop: Sequence[str] = [self.CLOSE] if stop_after_call else []

    def parse(self, text: str) -> list[ToolCall]:
        calls, at = [], 0
        while (start := text.find(self.OPEN, at)) >= 0:
            close = text.find(self.CLOSE, start)
            if close < 0:
                raise ValueError(f"{self.OPEN} opened but never closed with {self.CLOSE}")
            body = text[start + len(self.OPEN):close]
            at = close + len(self.CLOSE)
            calls.append(self._call(body, text[start:at]))
        return calls

    def _call(self, body: str, raw: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ValueError(f"the tool call is not valid JSON ({e}): {body.strip()[:200]}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ValueError(f'a tool call is an object with a "name" string, got: {body.strip()[:200]}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"the arguments of {call['name']!r} are not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f'the "arguments" of {call["name"]!r} must be an object, got {type(arguments).__name__}')
        return ToolCall(name=call["name"], arguments=arguments, raw=raw)

    def format_result(self, call: ToolCall, result: ToolResult) -> str:
        return f"error ({result.error}): {result.content}" if result.error else result.content
