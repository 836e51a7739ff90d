"""Renderers: messages to the tokens that extend a multi-turn sample (plugin kind ``renderer``).

The rollout worker owns each sample's token sequence: what the engine sampled is kept as sampled, and a
renderer only ever *appends* tokens for what the environment answered (a tool result, a user turn) and
for the opening of the next assistant turn. It never re-renders the history, so there is no
re-tokenisation drift between what the model saw and what the learner trains on.

- ``plain``: no chat template (the tiny character-level model). The prompt is the first observation's
  text; after each action, every observation message's content followed by `separator` is appended.
- ``chat_template``: the model folder's own Jinja ``chat_template`` (or one given, default ChatML). Each
  extension is the text the template adds when the assistant's turn (the sampled text, verbatim) and the
  new messages are appended; if the template would render the history differently (a template that
  drops earlier reasoning, say), `extend` returns None and the worker splits the sample instead.

`check_renderer` is the startup check: it renders a probe conversation incrementally and in one piece and
reports where the two differ (text not a prefix, or tokens that the tokenizer would merge differently).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tidal.core.protocol import ChatMessage, ToolSpec

log = logging.getLogger("tidal.rollout.renderers")

# ChatML (Qwen2-style) with tool support: the default when a model folder has no chat template
CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


class PlainRenderer:
    """Text as it is, for models without a chat template. `separator` follows each observation message."""

    def __init__(self, tokenizer: Any, *, separator: str = "\n", stop: Sequence[str] = ("\n",)) -> None:
        self.tokenizer, self.separator, self.stop = tokenizer, separator, tuple(stop)

    def start(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        return _encode(self.tokenizer, self.separator.join(m.content for m in messages))

    def extend(self, action_ids: Sequence[int], messages: Sequence[ChatMessage]) -> list[int] | None:
        return _encode(self.tokenizer, "".join(m.content + self.separator for m in messages))


def _tool_dicts(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in tools]


class ChatTemplateRenderer:
    """A Jinja chat template (the tokenizer's own, or `template`), extended turn by turn."""

    def __init__(self, tokenizer: Any, *, template: str = "", stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None) or CHATML
        self.stop = tuple(stop)
        self._messages: list[dict[str, str]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._text = ""

    def _render(self, messages: list[dict[str, str]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=self._tools, chat_template=self.template,
                                                      add_generation_prompt=True, tokenize=False))

    def start(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        self._tools = _tool_dicts(tools) or None
        self._messages = [_as_dict(m) for m in messages]
        self._text = self._render(self._messages)
        return _encode(self.tokenizer, self._text)

    def extend(self, action_ids: Sequence[int], messages: Sequence[ChatMessage]) -> list[int] | None:
        sampled = self.tokenizer.decode(list(action_ids), skip_special_tokens=False)
        content = self.tokenizer.decode(list(action_ids), skip_special_tokens=True)
        history = [*self._messages, {"role": "assistant", "content": content}, *(_as_dict(m) for m in messages)]
        text = self._render(history)
        prefix = self._text + sampled
        if not text.startswith(prefix):
            return None  # the template renders the history differently from what was sampled
        self._messages, self._text = history, text
        return _encode(self.tokenizer, text[len(prefix):])


def _as_dict(m: ChatMessage) -> dict[str, str]:
    d = {"role": m.role, "content": m.content}
    if m.name:
        d["name"] = m.name
    return d


PROBE = [
    ChatMessage(role="user", content="What is 12*34?"),
    ChatMessage(role="tool", name="calculator", content="408"),
    ChatMessage(role="user", content="And 5+6?"),
]
PROBE_ACTIONS = ["Let me compute 12*34.", "It is 408. Now 5+6", "Answer: 11"]


def check_renderer(make: Any, tokenizer: Any, tools: Sequence[ToolSpec] = ()) -> list[str]:
    """Render a probe conversation turn by turn with ``make()`` renderers and compare with encoding the
    whole text at once. Returns the problems found ([] = the renderer preserves prefixes for this
    tokenizer): a turn that cannot extend (the worker would split there), or tokens the tokenizer would
    merge differently across a boundary (the model then sees token sequences it was not trained on)."""
    problems: list[str] = []
    renderer = make()
    ids = renderer.start(PROBE[:1], tools)
    for turn, (action, obs) in enumerate(zip(PROBE_ACTIONS, [PROBE[1:2], PROBE[2:3], []], strict=True), 1):
        action_ids = _encode(tokenizer, action)
        ext = renderer.extend(action_ids, obs)
        if ext is None:
            problems.append(f"turn {turn}: the renderer cannot extend the sampled tokens (samples would split)")
            return problems
        ids = [*ids, *action_ids, *ext]
    whole = _encode(tokenizer, tokenizer.decode(ids, skip_special_tokens=False))
    if whole != ids:
        at = next((i for i, (a, b) in enumerate(zip(whole, ids, strict=False)) if a != b), min(len(whole), len(ids)))
        problems.append(f"tokens differ from encoding the whole conversation at position {at}: "
                        f"{tokenizer.decode(ids[max(0, at - 8):at + 8])!r}")
    return problems


__all__ = ["CHATML", "ChatTemplateRenderer", "PlainRenderer", "check_renderer"]
