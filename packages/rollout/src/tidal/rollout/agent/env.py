"""`agent`: an episodic environment whose episodes are an agent program written for the OpenAI API.

    domains = [{ env = { name = "agent", options = {
        command = ["python", "examples/openai_agent/agent.py", "{prompt}"],
        tasks = { name = "multiply" }, parser = "tags", parser_options = { tags = { calc = ["calculator", "expression"] } } } } }]

Each episode starts `command` (``{prompt}`` in an argument is the task's prompt; the agent's environment
gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the episode's key) and ``TIDAL_TASK_PROMPT``), in its own
process group, its output in the environment process's log folder. The agent calls the endpoint
(tidal.rollout.agent.endpoint) as it would call any OpenAI-compatible server; the episode turns each call
into what the rollout worker already drives, token in, token out:

- the first call's messages are the first observation, and its ``tools`` the episode's tools (rendered by
  the worker's renderer, which owns the tokens);
- each action the policy samples answers the waiting call: its text as the assistant message, the tool
  calls `parser` reads in it as ``tool_calls`` (``finish_reason`` ``tool_calls``);
- the agent's next call must repeat the history it was given (messages are compared by role, text, tool
  calls and tool call ids): what it appends (its tool results, as ``tool`` messages, shown to the model
  through `parser`'s `format_result`; user turns) is the next observation. A call whose history differs
  (the agent edited or dropped messages) restarts the conversation: the worker closes the sample there and
  starts a new one from a fresh render (``splits``, and ``history_rewrites`` in the episode's info);
- the episode ends when the agent exits: its outcome is the reward it posted (``POST /v1/tidal/reward``),
  else what the `reward` plugin (``{name, options}``, e.g. ``judge``) or, without one, the `tasks`
  environment's verifier says of the last answer. An agent that exits with an error
  before its first call, does not call within `timeout_s`, or sends a call the episode cannot read fails
  the episode (``env_error``), never a zero reward.

Sampling settings in a call (temperature, top_p, max_tokens, ...) are not applied: the run samples with the
recipe's, which the learner's logprobs assume; calls that carry them are counted (``sampling_ignored``).
The agent is the user's own program and runs unsandboxed, as the user; the model's text reaches only the
agent. An agent on ``/v1/completions`` sends text: a prompt that extends the previous prompt and its
answer adds its new text as an observation appended as it is (`Observation.text`: tokenised alone, no
renderer), any other prompt restarts the sample; one episode speaks one of the two APIs.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidal.core.episodes import AGENT, Observation, StepResult, ToolCall, ToolParser, ToolResult, real_reward
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.core.protocol import ChatMessage, ToolSpec
from tidal.rollout.agent.endpoint import AgentEndpoint, Call, CallRefused

SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "presence_penalty",
                 "frequency_penalty", "stop", "seed", "logit_bias", "top_k")


class AgentEnv:
    """Episodes run by an agent program; tasks and their verifier from the `tasks` environment."""

    def __init__(self, command: list[str], tasks: dict[str, Any], parser: str = "json",
                 parser_options: dict[str, Any] | None = None, max_turns: int = 8, timeout_s: float = 20.0,
                 model: str = "tidal-policy", cwd: str = "", log_dir: str = "",
                 reward: dict[str, Any] | None = None) -> None:
        if not command or not all(isinstance(c, str) for c in command):
            raise ValueError(f"command is the agent's argv, a list of strings; got {command!r}")
        if not isinstance(tasks, dict) or not tasks.get("name"):
            raise ValueError(f"tasks names the environment that poses the tasks and verifies the answers: "
                             f"{{name = \"multiply\", options = {{...}}}}; got {tasks!r}")
        self.command, self.max_turns, self.timeout_s, self.model = list(command), int(max_turns), timeout_s, model
        self.cwd = cwd or None
        self.inner = registry.build("env", tasks["name"], tasks.get("options") or {}, field="tasks")
        self.verify = getattr(self.inner, "verify", None) or self.inner.score
        # `reward` = {name, options}: a reward plugin (`tidal plugins reward`: judge, exact_match, ...) scores the
        # agent's last answer instead of the tasks environment's verifier
        self.reward = registry.build("reward", reward["name"], reward.get("options") or {}, field="reward") \
            if reward else None
        self.parser: ToolParser = registry.build("tool_parser", parser, parser_options or {}, field="parser")
        self._log_dir = log_dir  # "" = the environment process's log folder (TIDAL_LOG_DIR), else a temporary one
        self._endpoint: AgentEndpoint | None = None
        self.domain = getattr(self.inner, "domain", tasks["name"])

    @property
    def log_dir(self) -> Path:
        """Where each agent's output goes (agent-<key>.log); decided by the first episode, not at build (the
        driver builds the environment to check it, and starts no agent)."""
        if not self._log_dir:
            self._log_dir = os.environ.get("TIDAL_LOG_DIR") or tempfile.mkdtemp(prefix="tidal-agent-")
        return Path(self._log_dir)

    @property
    def endpoint(self) -> AgentEndpoint:
        if self._endpoint is None:  # started by the first episode, in the process that runs them
            self._endpoint = AgentEndpoint(self.model)
        return self._endpoint

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return self.inner.tasks(split, seed)

    def episode(self, task: Task) -> AgentEpisode:
        return AgentEpisode(self, task)


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise CallRefused(400, f"a message content the policy cannot read (text only): {str(content)[:120]}")


def _calls(message: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(name, arguments, id) of a message's tool calls, arguments parsed (for comparing)."""
    out = []
    for c in message.get("tool_calls") or []:
        f = c.get("function") or {}
        args = f.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((str(f.get("name", "")), args, str(c.get("id", ""))))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two chat messages alike by what is rendered: role, text, tool calls, tool call id, name."""
    return (a.get("role") == b.get("role") and _text(a.get("content")) == _text(b.get("content"))
            and _calls(a) == _calls(b) and (a.get("tool_call_id") or "") == (b.get("tool_call_id") or ""))


def _tools(body: dict[str, Any]) -> list[ToolSpec]:
    out = []
    for t in body.get("tools") or []:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not f.get("name"):
            raise CallRefused(400, f"a tool the episode cannot read (expected {{type: function, function: "
                                   f"{{name, description, parameters}}}}): {str(t)[:120]}")
        out.append(ToolSpec(name=str(f["name"]), description=str(f.get("description") or ""),
                            parameters=dict(f.get("parameters") or {})))
    return out


class AgentEpisode:
    roles = (AGENT,)

    def __init__(self, env: AgentEnv, task: Task) -> None:
        self.env, self.task = env, task
        self.key = "tidal-" + secrets.token_hex(16)
        self.tools: list[ToolSpec] = []
        self.stop = list(env.parser.stop)
        self.history: list[dict[str, Any]] = []  # the conversation as the agent was given it
        self.names: dict[str, str] = {}  # tool call id -> tool name (tool messages name their call by id)
        self.pending: Call | None = None
        self.proc: subprocess.Popen | None = None
        self.last_answer = ""
        self.turn = 0
        self.kind = "chat"  # the first call's: "chat" (/v1/chat/completions) or "text" (/v1/completions)
        self.text = ""  # a text episode's prompt and answers so far, as the agent was given them

    # ------------------------------------------------------------------ the agent's process

    def _start(self) -> None:
        argv = [a.replace("{prompt}", self.task.prompt) for a in self.env.command]
        env = {**os.environ, "OPENAI_BASE_URL": self.env.endpoint.base_url, "OPENAI_API_KEY": self.key,
               "TIDAL_TASK_PROMPT": self.task.prompt}
        self.log = self.env.log_dir / f"agent-{self.key[-8:]}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=self.env.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-1500:].strip() or "(no output)"
        except OSError:
            return "(no output)"

    def _next(self) -> Call | None:
        """The agent's next call, or None when it exited; raises TimeoutError past timeout_s."""
        assert self.proc is not None
        deadline = time.monotonic() + self.env.timeout_s
        while True:
            try:
                return self.session.inbox.get(timeout=0.02)
            except queue.Empty:
                pass
            if self.proc.poll() is not None:
                try:  # a call sent just before it exited still counts
                    return self.session.inbox.get_nowait()
                except queue.Empty:
                    return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent made no call within {self.env.timeout_s:g} s (timeout_s); its "
                                   f"output ends: {self._tail()}")

    # ------------------------------------------------------------------ the episode

    def reset(self) -> Observation:
        self.session = self.env.endpoint.open(self.key)
        self._start()
        call = self._next()
        if call is None:
            raise RuntimeError(f"the agent exited (code {self.proc.returncode if self.proc else '?'}) before its "
                               f"first call: {self._tail()}")
        self.kind, self.pending = call.kind, call  # the API this episode speaks: "chat" or "text"
        if call.kind == "text":
            self.text = self._read(call)
            return Observation(text=self.text)
        messages = self._read(call)
        self.tools = _tools(call.body)
        self.history = messages
        return Observation(messages=[self._message(m) for m in messages])

    def _read(self, call: Call) -> Any:
        """The call's messages, or a text call's prompt (a refused call is answered with its error, and fails
        the episode)."""
        try:
            if call.kind != self.kind:
                began = "/v1/completions" if self.kind == "text" else "/v1/chat/completions"
                raise CallRefused(400, f"this episode began on {began}: one episode speaks one API")
            if call.kind == "text":
                return call.body["prompt"]  # a non-empty string (the endpoint checked)
            messages = call.body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise CallRefused(400, "messages must be a non-empty list of message objects")
            for m in messages:
                _text(m.get("content"))
            return messages
        except CallRefused as e:
            call.answer.set_exception(e)
            raise ValueError(f"the agent sent a call the episode cannot read: {e.message}") from None

    def _message(self, m: dict[str, Any]) -> ChatMessage:
        """A message of the agent's history as the renderer shows it; tool results through the parser."""
        role, text = str(m.get("role", "")), _text(m.get("content"))
        if role == "tool":
            name = self.names.get(str(m.get("tool_call_id", "")), str(m.get("name") or ""))
            text = self.env.parser.format_result(ToolCall(name=name), ToolResult(content=text))
            return ChatMessage(role="tool", content=text, name=name)
        if role == "assistant" and m.get("tool_calls") and not text:
            text = json.dumps([{"name": n, "arguments": a} for n, a, _ in _calls(m)])
        return ChatMessage(role=role, content=text)

    def step(self, action: str, role: str = AGENT) -> StepResult:
        assert self.pending is not None
        self.turn += 1
        info = {"sampling_ignored": float(any(k in self.pending.body for k in SAMPLING_KEYS))}
        if self.kind == "text":
            self.pending.answer.set_result(self._text_completion(action))
            self.text += action
        else:
            message, calls = self._answer(action, info)
            self.pending.answer.set_result(self._completion(message, calls))
            self.history.append(message)
        self.last_answer, self.pending = action, None
        call = self._next()
        if call is None:
            return StepResult(done=True, info=info)
        read = self._read(call)
        self.pending = call
        if self.kind == "text":
            return StepResult(observation=self._text_observation(read, info), info=info)
        messages, n = read, len(self.history)
        if len(messages) > n and all(same(a, b) for a, b in zip(self.history, messages[:n], strict=False)):
            new, restart = messages[n:], False
        else:  # the agent rewrote what it was given: the conversation starts over
            new, restart = messages, True
            info["history_rewrites"] = 1.0
        self.history = messages
        return StepResult(observation=Observation(messages=[self._message(m) for m in new], restart=restart),
                          info=info)

    def _text_observation(self, prompt: str, info: dict[str, float]) -> Observation:
        """A text call's new prompt: what it adds after the previous prompt and answer, or all of it anew."""
        if len(prompt) > len(self.text) and prompt.startswith(self.text):
            obs = Observation(text=prompt[len(self.text):])
        else:  # the agent rewrote the text it was given: the sample starts over
            obs, info["history_rewrites"] = Observation(text=prompt, restart=True), 1.0
        self.text = prompt
        return obs

    def _text_completion(self, action: str) -> dict[str, Any]:
        return {"id": f"cmpl-{self.key[-8:]}-{self.turn}", "object": "text_completion", "created": int(time.time()),
                "model": self.env.model, "choices": [{"index": 0, "text": action, "logprobs": None,
                                                      "finish_reason": "stop"}]}

    def _answer(self, action: str, info: dict[str, float]) -> tuple[dict[str, Any], int]:
        try:
            parsed = self.env.parser.parse(action)
        except ValueError:  # a call the parser recognises but cannot read: the agent gets the text
            parsed, info["invalid_calls"] = [], 1.0
        calls = []
        for i, c in enumerate(parsed):
            cid = f"call_{self.key[-8:]}_{self.turn}_{i}"
            self.names[cid] = c.name
            calls.append({"id": cid, "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
        info["tool_calls"] = float(len(calls))
        message: dict[str, Any] = {"role": "assistant", "content": action}
        if calls:
            message["tool_calls"] = calls
        return message, len(calls)

    def _completion(self, message: dict[str, Any], calls: int) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.key[-8:]}-{self.turn}", "object": "chat.completion",
                "created": int(time.time()), "model": self.env.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if calls else "stop"}]}

    def outcome(self) -> float:
        if self.session.reward is not None:
            return real_reward(self.session.reward, "the agent's posted reward")
        if self.env.reward is not None:
            return real_reward(self.env.reward(self.task, self.last_answer), "the reward plugin")
        return real_reward(self.env.verify(self.task, self.last_answer), "the tasks environment's verifier")

    def close(self) -> None:
        if self.pending is not None and not self.pending.answer.done():  # its turn limit, a failure, the run
            self.pending.answer.set_exception(CallRefused(409, "the episode ended before this call was answered "
                                                               "(its turn limit, a failure, or the run stopping)",
                                                          "episode_ended"))
        self.env.endpoint.end(self.key, "closed")
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)
