"""The `agent` environment: a real agent process using the plain `openai` client against the episode's
OpenAI-compatible endpoint (real HTTP through uvicorn), driven by hand (the episode's side) and by the
worker's episode driver with the real embedded engine (token capture)."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tidal.core.config import Domain, PluginRef
from tidal.core.interfaces import Task
from tidal.core.protocol import NO_VERSION, SamplingParams
from tidal.rollout.agent.env import AgentEnv
from tidal.rollout.episodes.local import LocalEpisodes
from tidal.rollout.episodes.multiturn import EpisodesConfig, run_episodes
from tidal.rollout.episodes.renderers import PlainRenderer
from tidal.rollout.tiny import load_tokenizer

PROBE = str(Path(__file__).with_name("agent_probe.py"))
TAGS = {"tags": {"calc": ["calculator", "expression"]}}
pytestmark = pytest.mark.timeout(180)


def env(mode: str, tmp_path, **kw) -> AgentEnv:
    return AgentEnv(command=[sys.executable, PROBE, mode, "{prompt}"], tasks={"name": "multiply"}, parser="tags",
                    parser_options=TAGS, log_dir=str(tmp_path), **kw)


def agent_saw(tmp_path) -> list[dict]:
    (log,) = tmp_path.glob("agent-*.log")
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_tool_calls_reach_the_agent_as_function_calls_and_its_results_come_back_through_the_parser(tmp_path):
    e = env("tools", tmp_path)
    ep = e.episode(Task(prompt="12*34=", answer="408", domain="multiply"))
    try:
        first = ep.reset()
        assert [(m.role, m.content) for m in first.messages] == [("user", "12*34=")]
        assert [t.name for t in ep.tools] == ["calculator"] and ep.stop == ["</calc>"]
        step = ep.step("<calc>12*34</calc>")  # the agent runs its calculator and calls again
        assert not step.done and not step.observation.restart and step.info["tool_calls"] == 1
        assert [(m.role, m.name, m.content) for m in step.observation.messages] == [
            ("tool", "calculator", "<result>408</result>")]
        assert ep.step("Answer: 408").done  # no call in it: the agent's final answer, and it exits
        assert ep.outcome() == 1.0  # multiply's verifier on the last answer
    finally:
        ep.close()
        e.endpoint.close()
    # a named reward plugin scores the last answer instead: exact_match wants "408" alone
    strict = env("tools", tmp_path / "strict", reward={"name": "exact_match"})
    (tmp_path / "strict").mkdir()
    ep = strict.episode(Task(prompt="12*34=", answer="408", domain="multiply"))
    try:
        ep.reset()
        ep.step("<calc>12*34</calc>")
        assert ep.step("Answer: 408").done and ep.outcome() == 0.0
    finally:
        ep.close()
        strict.endpoint.close()
    saw = agent_saw(tmp_path)
    assert saw[0]["finish_reason"] == "tool_calls" and saw[0]["tool_calls"] == [
        {"name": "calculator", "arguments": json.dumps({"expression": "12*34"})}]
    assert saw[1] == {"turn": 1, "content": "Answer: 408", "finish_reason": "stop", "tool_calls": []}


def test_a_rewritten_history_restarts_the_conversation_and_a_posted_reward_is_the_outcome(tmp_path):
    e = env("rewrite", tmp_path)
    ep = e.episode(Task(prompt="2*3=", answer="6", domain="multiply"))
    try:
        ep.reset()
        step = ep.step("5")
        assert step.observation.restart and step.info["history_rewrites"] == 1
        assert [m.content for m in step.observation.messages] == ["2*3=?"]
        assert ep.step("6").done and ep.outcome() == 1.0  # the verifier reads the last answer
    finally:
        ep.close()
    (tmp_path / "r").mkdir()
    r = env("reward", tmp_path / "r")
    ep = r.episode(Task(prompt="2*3=", answer="6", domain="multiply"))
    try:
        ep.reset()
        assert ep.step("7").done and ep.outcome() == 0.25  # the agent's own reward, not the verifier's 0
    finally:
        ep.close()
        e.endpoint.close()
        r.endpoint.close()


def test_a_call_left_waiting_when_the_episode_ends_is_answered_409(tmp_path):
    """At its turn limit the environment process ends an episode whose agent has already called again:
    that call is answered (409, the episode ended), not left hanging in the server."""
    e = AgentEnv(command=[sys.executable, PROBE, "turns", "{prompt}"], tasks={"name": "arithmetic"},
                 log_dir=str(tmp_path), max_turns=1)
    ep = e.episode(Task(prompt="2+2=", answer="4"))
    try:
        ep.reset()
        assert not ep.step("4").done  # the agent called again (its user turn "next")
        waiting = ep.pending
        ep.close()
        assert waiting is not None and waiting.answer.exception().status == 409
    finally:
        ep.close()
        e.endpoint.close()


def test_a_text_completion_agent_adds_only_its_new_text(tmp_path):
    e = AgentEnv(command=[sys.executable, PROBE, "text", "{prompt}"], tasks={"name": "arithmetic"},
                 log_dir=str(tmp_path))
    ep = e.episode(Task(prompt="2+2=", answer="4"))
    try:
        assert ep.reset().text == "2+2="
        step = ep.step("4")
        assert step.observation.text == " next:" and not step.observation.restart and not step.observation.messages
        assert ep.step(" 5").observation.text == " next:"
        assert ep.step("6").done and ep.outcome() == 0.0  # arithmetic's score of the last answer, "6"
    finally:
        ep.close()
        e.endpoint.close()
    assert [s["content"] for s in agent_saw(tmp_path)] == ["4", " 5", "6"]


def test_an_agent_that_crashes_or_never_calls_fails_its_episode_with_its_output(tmp_path):
    e = env("crash", tmp_path)
    with pytest.raises(RuntimeError, match=r"exited \(code 3\) before its first call: probe: crash\ncrashing on purpose"):
        e.episode(Task(prompt="1*1=", answer="1")).reset()
    silent = env("silent", tmp_path, timeout_s=1.0)
    ep = silent.episode(Task(prompt="1*1=", answer="1"))
    with pytest.raises(TimeoutError, match="no call within 1 s"):
        ep.reset()
    ep.close()
    assert ep.proc is not None and ep.proc.poll() is not None  # closing the episode killed its agent
    e.endpoint.close()
    silent.endpoint.close()


def _post(url: str, body: dict, key: str = "") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_endpoint_refuses_unknown_keys_streams_text_prompts_and_bad_rewards(tmp_path):
    e = env("silent", tmp_path)
    url = e.endpoint.base_url
    try:
        e.endpoint.open("k1")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert _post(url + "/chat/completions", chat, "nope")[0] == 401
        assert _post(url + "/chat/completions", {**chat, "stream": True}, "k1")[0] == 400
        assert _post(url + "/chat/completions", {**chat, "n": 2}, "k1")[0] == 400
        assert _post(url + "/completions", {"prompt": [1, 2, 3]}, "k1")[0] == 400  # token ids: not served
        code, body = _post(url + "/completions", {"prompt": "hi", "echo": True}, "k1")
        assert code == 400 and "echo" in body["error"]["message"]
        assert _post(url + "/tidal/reward", {"reward": float("nan")}, "k1")[0] == 400
        assert _post(url + "/tidal/reward", {"reward": "1.0"}, "k1")[0] == 400
        assert _post(url + "/tidal/reward", {"reward": 1}, "k1") == (200, {"ok": True, "reward": 1.0})
    finally:
        e.endpoint.close()


def test_the_tokens_an_agent_was_answered_with_are_the_tokens_the_engine_sampled(tiny_model, tmp_path):
    """Multi-turn through the worker's episode driver and the real embedded engine: every sample's trained
    tokens are exactly what the engine sampled at each call, the agent was answered with their text, and the
    user turns the agent added are observation tokens (mask 0); a rewritten history splits the sample."""
    from tidal.rollout.engines.embedded import EmbeddedEngine

    tok = load_tokenizer(tiny_model)
    turns = Domain(name="turns", env=PluginRef(name="agent", options={
        "command": [sys.executable, PROBE, "turns", "{prompt}"], "tasks": {"name": "arithmetic"},
        "log_dir": str(tmp_path)}))
    rewrite = Domain(name="rewrite", env=PluginRef(name="agent", options={
        "command": [sys.executable, PROBE, "rewrite", "{prompt}"], "tasks": {"name": "arithmetic"},
        "log_dir": str(tmp_path)}))
    text = Domain(name="text", env=PluginRef(name="agent", options={
        "command": [sys.executable, PROBE, "text", "{prompt}"], "tasks": {"name": "arithmetic"},
        "log_dir": str(tmp_path)}))
    sampling = SamplingParams(temperature=1.0, max_tokens=5, seed=3)
    pool = LocalEpisodes([turns, rewrite, text])
    results: dict[str, list[int]] = {}
    with EmbeddedEngine(str(tiny_model), max_num_seqs=8, seed=0) as engine:
        poll = engine.poll

        def recording_poll(timeout=None):
            out = poll(timeout)
            results.update((r.request_id, list(r.completion_ids)) for r in out)
            return out

        engine.poll = recording_poll
        tasks = [Task(prompt=f"{i}+{i}=", answer=str(2 * i), domain="turns") for i in range(3)]

        def episodes(domain: str, n: int) -> tuple[list, dict[str, list[int]]]:
            results.clear()  # request ids repeat across calls (local-00000:0/0, ...): each call's own
            runs = run_episodes(engine, tok, pool, domain, tasks[:n], sampling, EpisodesConfig(max_tokens=200),
                                lambda: PlainRenderer(tok), timeout=120)
            return runs, dict(results)

        runs, sampled_by_id = episodes("turns", 3)
        (split,), _ = episodes("rewrite", 1)
        (plain,), text_sampled = episodes("text", 1)
    pool.close()
    decoded = {tok.decode(s, skip_special_tokens=True) for s in sampled_by_id.values()}
    for run in runs:
        assert run is not None and run.turns == 3
        (seg,) = run.segments
        sampled = [sampled_by_id[f"{run.id}/{k}"] for k in range(3)]
        assert [t for t, m in zip(seg.ids, seg.mask, strict=True) if m] == [t for s in sampled for t in s]
        assert all(v == NO_VERSION for v, m in zip(seg.versions, seg.mask, strict=True) if not m)
        text = tok.decode(seg.prompt + seg.ids, skip_special_tokens=True)
        assert text.count("next\n") == 2  # the agent's two user turns, as observations
    answered = [s["content"] for s in agent_saw_all(tmp_path, "turns")]
    assert len(answered) == 9 and set(answered) <= decoded  # the agents got the sampled text
    assert split is not None and len(split.segments) == 2 and split.info["history_rewrites"] == 1
    # /v1/completions: the sample is the agent's text exactly, its prompt's additions appended as they are
    (seg,) = plain.segments
    sampled = [text_sampled[f"{plain.id}/{k}"] for k in range(3)]
    assert [t for t, m in zip(seg.ids, seg.mask, strict=True) if m] == [t for s in sampled for t in s]
    answers = [tok.decode(s, skip_special_tokens=True) for s in sampled]
    assert tok.decode(seg.prompt + seg.ids, skip_special_tokens=True) == "0+0=" + " next:".join(answers)


def agent_saw_all(tmp_path, mode: str) -> list[dict]:
    """What every agent of `mode` printed (its first line names the mode)."""
    out = []
    for log in tmp_path.glob("agent-*.log"):
        lines = log.read_text().splitlines()
        if lines and lines[0] == f"probe: {mode}":
            out += [json.loads(line) for line in lines[1:] if line.startswith("{")]
    return out
