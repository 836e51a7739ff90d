"""Renderers extend what was sampled, never re-render it: with the tiny char tokenizer and a real
byte-level BPE with ChatML (both built here), the tokens of a multi-turn sample are exactly the prompt,
the sampled actions and the extensions, and they equal what the tokenizer makes of the whole text."""

from __future__ import annotations

import pytest

from tidal.core.plugins import registry
from tidal.core.protocol import ChatMessage, ToolSpec
from tidal.rollout.episodes.renderers import CHATML, ChatTemplateRenderer, PlainRenderer, check_renderer
from tidal.rollout.tiny import build_char_tokenizer, build_chatml_tokenizer

CALC = ToolSpec(name="calculator", description="evaluates arithmetic",
                parameters={"type": "object", "properties": {"expression": {"type": "string"}}})


@pytest.fixture(scope="module")
def bpe():
    return build_chatml_tokenizer()


def test_plain_renderer_appends_observations_after_the_sampled_tokens():
    tok = build_char_tokenizer("0123456789*=? <>/acelrstuAnw:\n")
    r = PlainRenderer(tok)
    prompt = r.start([ChatMessage(role="user", content="12*34=?")], [CALC])
    action = tok.encode("<calc>12*34</calc>")
    ext = r.extend(action, [ChatMessage(role="tool", name="calculator", content="<result>408</result>")])
    assert tok.decode(prompt + action + ext) == "12*34=?<calc>12*34</calc><result>408</result>\n"


def test_plain_renderer_passes_the_startup_check_with_the_char_tokenizer():
    tok = build_char_tokenizer()
    assert check_renderer(lambda: PlainRenderer(tok), tok) == []


def test_chatml_extension_is_what_the_template_adds(bpe):
    r = ChatTemplateRenderer(bpe)
    assert r.template == CHATML  # the tokenizer's own template
    prompt = r.start([ChatMessage(role="user", content="What is 12*34?")], [CALC])
    text0 = bpe.decode(prompt)
    assert text0.endswith("<|im_start|>assistant\n") and '"name": "calculator"' in text0
    # the model stopped on its tool call's closing tag, without ending its turn
    action = bpe.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
                        add_special_tokens=False)
    ext = r.extend(action, [ChatMessage(role="tool", name="calculator", content="408")])
    assert bpe.decode(ext) == "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    # a turn ended by the model's own <|im_end|>: nothing of it is rendered again
    action2 = [*bpe.encode("The answer is 408.", add_special_tokens=False), bpe.convert_tokens_to_ids("<|im_end|>")]
    ext2 = r.extend(action2, [ChatMessage(role="user", content="thanks")])
    assert bpe.decode(ext2) == "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
    ids = prompt + action + ext + action2 + ext2
    history = [{"role": "user", "content": "What is 12*34?"},
               {"role": "assistant", "content": bpe.decode(action)},
               {"role": "tool", "content": "408"},
               {"role": "assistant", "content": "The answer is 408."},
               {"role": "user", "content": "thanks"}]
    whole = bpe.apply_chat_template(history, tools=[{"type": "function", "function": {
        "name": CALC.name, "description": CALC.description, "parameters": CALC.parameters}}],
        add_generation_prompt=True, tokenize=False)
    assert bpe.decode(ids) == whole
    assert bpe.encode(whole, add_special_tokens=False) == ids  # and the tokens are what the template gives


def test_chatml_passes_the_startup_check(bpe):
    assert check_renderer(lambda: ChatTemplateRenderer(bpe), bpe, [CALC]) == []


def test_a_template_that_rewrites_history_cannot_extend(bpe):
    # renders earlier assistant turns without what came before "</think>" (as reasoning templates do)
    dropping = CHATML.replace("message.content + '<|im_end|>", "message.content.split('</think>')[-1] + '<|im_end|>")
    assert dropping != CHATML
    r = ChatTemplateRenderer(bpe, template=dropping)
    r.start([ChatMessage(role="user", content="hi")], [])
    action = bpe.encode("<think>hmm</think>408", add_special_tokens=False)
    assert r.extend(action, [ChatMessage(role="user", content="ok")]) is None


def test_renderers_are_plugins_with_checked_options(bpe):
    assert {"plain", "chat_template"} <= set(registry.names("renderer"))
    r = registry.build("renderer", "chat_template", {"stop": ["</tool_call>"]}, bpe, field="rollout.renderer")
    assert isinstance(r, ChatTemplateRenderer) and r.stop == ("</tool_call>",)
    from tidal.core.errors import ConfigError

    with pytest.raises(ConfigError, match="separatr"):
        registry.check("renderer", "plain", {"separatr": "\n"}, field="rollout.renderer")
