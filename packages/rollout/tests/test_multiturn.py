"""Multi-turn samples, token-in/token-out: the worker's episode driver (tidal.rollout.episodes.multiturn) with the
real embedded engine on the tiny model and real episodes (in-process host and environment processes).

For every sample: the engine saw, at each turn, exactly the sample's tokens so far; the segments' tokens
are the prompt, the sampled actions and the renderer's extensions, nothing re-tokenised; loss_mask is 1
on exactly the sampled tokens; observation tokens carry NO_VERSION and logprob 0; each step's reward sits
at the completion index where its action ended."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.config import Domain, PluginRef
from tidal.core.interfaces import Task
from tidal.core.protocol import NO_VERSION, SamplingParams, trajectory_id
from tidal.rollout.episodes.local import LocalEpisodes
from tidal.rollout.episodes.multiturn import EpisodesConfig, MultiTurn, run_episodes
from tidal.rollout.episodes.pool import EnvPool
from tidal.rollout.episodes.renderers import PlainRenderer
from tidal.rollout.tiny import load_tokenizer

DOMAINS = [Domain(env=PluginRef(name="counting", options={"turns": 3}))]
SAMPLING = SamplingParams(temperature=1.0, max_tokens=6, stop=["\n"], seed=7)


class Recording:
    """The real engine, with every request it was given kept (what the engine saw)."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def submit(self, request):
        self.requests.append(request)
        self.engine.submit(request)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(autouse=True)
def _plugins_importable(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # envpool_plugins, for the in-process host


@pytest.fixture(scope="module")
def engine(tiny_model):
    from tidal.rollout.engines.embedded import EmbeddedEngine

    e = EmbeddedEngine(str(tiny_model), max_num_seqs=16, seed=0)
    yield Recording(e)
    e.close()


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def _tasks(n):
    return [Task(prompt=f"task {i}", domain="counting") for i in range(n)]


def _check_sample(run, engine, tok):
    (seg,) = run.segments
    seen = [r for r in engine.requests if r.request_id.startswith(run.id + "/")]
    assert len(seen) == run.turns == 3
    sequence = [*seg.prompt, *seg.ids]
    ends = []
    for k, req in enumerate(seen):  # turn k was generated from exactly the sample's tokens up to there
        assert list(req.prompt_ids) == sequence[: len(req.prompt_ids)]
        start = len(req.prompt_ids) - len(seg.prompt)
        assert all(m == 0 for m in seg.mask[len(ends) and ends[-1]:start]), "only sampled tokens are trained"
        nxt = len(seen[k + 1].prompt_ids) - len(seg.prompt) if k + 1 < len(seen) else len(seg.ids)
        action_end = next((i for i in range(start, nxt) if seg.mask[i] == 0), nxt)
        assert all(m == 1 for m in seg.mask[start:action_end])
        ends.append(action_end)
    assert seg.step_ends == ends  # each step's reward where its action's tokens end
    # no update in flight: each turn's KV (the history rebuilt for its request) is as new as its tokens
    assert seg.kv_versions == seg.versions
    for i, m in enumerate(seg.mask):
        if m == 0:
            assert seg.versions[i] == NO_VERSION and seg.logprobs[i] == 0.0
        else:
            assert seg.versions[i] >= 0 and seg.logprobs[i] <= 0.0
    # the rewards are the environment's: 1 for each turn whose action said the right number
    starts = [0, *ends[:-1]]
    actions = [tok.decode([t for t, m in zip(seg.ids[s:e], seg.mask[s:e], strict=True) if m], skip_special_tokens=True)
               for s, e in zip(starts, ends, strict=True)]
    assert seg.step_rewards == [float(a.strip() == str(k + 1)) for k, a in enumerate(actions)]
    assert run.outcome == pytest.approx(sum(seg.step_rewards) / 3)


def test_local_episodes_extend_exactly_what_was_sampled(engine, tok):
    engine.requests.clear()
    runs = run_episodes(engine, tok, LocalEpisodes(DOMAINS, plugins=["envpool_plugins"]), "counting", _tasks(6),
                        SAMPLING, EpisodesConfig(max_tokens=200), lambda: PlainRenderer(tok), timeout=120)
    assert all(r is not None for r in runs)
    for run in runs:
        _check_sample(run, engine, tok)
        # the plain renderer appended each observation's text and a newline, as text it re-decodes to
        (seg,) = run.segments
        text = tok.decode(seg.prompt + seg.ids, skip_special_tokens=True)
        assert text.startswith("task ") and "said " in text and text.count("; next\n") == 2


def test_episodes_in_environment_processes_and_their_trajectories(engine, tok, tmp_path):
    import os
    from pathlib import Path

    here = str(Path(__file__).parent)
    engine.requests.clear()
    with EnvPool(DOMAINS, processes=2, plugins=["envpool_plugins"], log_dir=tmp_path,
                 environ={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}) as pool:  # started on entering
        mt = MultiTurn(EpisodesConfig(max_tokens=200), pool, engine, tok, lambda: PlainRenderer(tok))
        from tidal.core.arrays import Array
        from tidal.core.protocol import Assignment

        a = Assignment(group_id="counting-0000001", prompt_ids=Array.from_numpy(np.zeros(0, np.int32)),
                       num_samples=4, task="counting", sampling=SAMPLING, prompt="task 1")
        mt.start(a, Task(prompt="task 1", domain="counting"))
        done = None
        import time

        deadline = time.monotonic() + 120
        while done is None and time.monotonic() < deadline:
            for reply in pool.poll(timeout=0.01):
                done = mt.on_reply(reply) or done
            for res in engine.poll(timeout=0.01):
                mt.on_result(res)
        assert done == a.group_id
        for i in range(4):
            _check_sample(mt.runs[trajectory_id(a.group_id, i)], engine, tok)
        trajs = mt.trajectories(a.group_id, "rollout-0")
        assert [t.id for t in trajs] == [trajectory_id(a.group_id, i) for i in range(4)]
        for t in trajs:
            run = mt.runs[t.id]
            (seg,) = run.segments
            assert t.group_size == 4 and t.reward == run.outcome
            assert t.completion_ids.numpy().tolist() == seg.ids
            assert t.loss_mask.numpy().tolist() == seg.mask
            assert t.kv_versions is not None and t.kv_versions.numpy().tolist() == seg.kv_versions
            assert t.step_ends.numpy().tolist() == seg.step_ends
            assert t.step_rewards.numpy().tolist() == seg.step_rewards
            assert t.metadata["tidal.episode.turns"] == "3"
        metrics = mt.metrics()
        assert metrics["rollout/episodes/episodes"] == 4 and metrics["rollout/episodes/turns_per_episode"] == 3
        assert metrics["rollout/envpool/episodes_opened"] == 4


def test_a_truncated_first_observation_is_counted_in_the_worker_metrics_and_the_prompt_stays_small(engine, tok):
    from tidal.core.arrays import Array
    from tidal.core.protocol import Assignment

    pool = LocalEpisodes([Domain(name="flood", env=PluginRef(name="flooding", options={"reset_chars": 50_000}))],
                         plugins=["envpool_plugins"], max_observation_chars=300)
    mt = MultiTurn(EpisodesConfig(max_tokens=200), pool, engine, tok, lambda: PlainRenderer(tok))
    a = Assignment(group_id="flood-0000001", prompt_ids=Array.from_numpy(np.zeros(0, np.int32)), num_samples=1,
                   task="flood", sampling=SAMPLING, prompt="p")
    mt.start(a, Task(prompt="p", domain="flood"))
    try:
        (reply,) = pool.poll()
        assert mt.on_reply(reply) is None  # rendered, its first turn submitted
        metrics = mt.metrics()
        assert metrics["rollout/episodes/info/observations_truncated"] == 1
        assert metrics["rollout/episodes/info/observation_chars_dropped"] == 50_000 - 300
        prompt = mt.runs[trajectory_id(a.group_id, 0)].segments[0].prompt
        assert len(prompt) < 400, "the renderer saw the capped observation, not 50,000 characters"
    finally:
        mt.forget(a.group_id)  # aborts the turn in the shared engine


class NoExtend(PlainRenderer):
    """A renderer whose template cannot extend what was sampled (as one that rewrites history)."""

    def extend(self, action_ids, messages):
        return None


def test_a_renderer_that_cannot_extend_splits_the_sample(engine, tok):
    engine.requests.clear()
    pool = LocalEpisodes(DOMAINS, plugins=["envpool_plugins"])
    (run,) = run_episodes(engine, tok, pool, "counting", _tasks(1), SAMPLING, EpisodesConfig(max_tokens=200),
                          lambda: NoExtend(tok), timeout=120)
    assert run is not None and len(run.segments) == 3  # one segment per turn: each turn a fresh render
    seen = [r for r in engine.requests if r.request_id.startswith(run.id + "/")]
    for seg, req in zip(run.segments, seen, strict=True):
        assert list(req.prompt_ids) == seg.prompt  # each segment starts where the engine started
        assert seg.mask == [1] * len(seg.ids) and len(seg.step_ends) == 1 and seg.step_ends[0] == len(seg.ids)
    # a fresh render is the whole conversation so far, as text: the earlier turns are in the prompt
    assert tok.decode(run.segments[2].prompt).startswith(tok.decode(run.segments[0].prompt))


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer and its own ChatML chat template (saved in the folder)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tidal.rollout.tiny import build_chatml_tokenizer

    path = tmp_path_factory.mktemp("chatml") / "model"
    tok = build_chatml_tokenizer(corpus=["task 0: count from 1 to 3", "said 1; next", "1 2 3 said next"] * 3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                             "pad_token_id": tok.pad_token_id}))
    return path


def test_a_bpe_model_with_its_own_chat_template_extends_turn_by_turn(chatml_model):
    from tidal.core.plugins import registry
    from tidal.rollout.engines.embedded import EmbeddedEngine
    from tidal.rollout.episodes.renderers import CHATML

    tok = load_tokenizer(chatml_model)
    assert tok.chat_template == CHATML  # the folder's own template, as saved
    engine = Recording(EmbeddedEngine(str(chatml_model), max_num_seqs=16, seed=0))
    try:
        make = lambda: registry.build("renderer", "chat_template", {}, tok)  # noqa: E731
        runs = run_episodes(engine, tok, LocalEpisodes(DOMAINS, plugins=["envpool_plugins"]), "counting", _tasks(8),
                            SAMPLING, EpisodesConfig(max_tokens=400), make, timeout=120)
    finally:
        engine.engine.close()
    unsplit = 0
    for run in runs:
        assert run is not None and run.turns == 3
        seen = iter(r for r in engine.requests if r.request_id.startswith(run.id + "/"))
        for seg in run.segments:  # every turn was generated from exactly its segment's tokens so far
            tokens = [*seg.prompt, *seg.ids]
            for _ in seg.step_ends:
                req = next(seen)
                assert list(req.prompt_ids) == tokens[: len(req.prompt_ids)]
            assert len(seg.mask) == len(seg.ids) and all(
                (m == 1) == (v >= 0) for m, v in zip(seg.mask, seg.versions, strict=True))
        if len(run.segments) == 1:
            unsplit += 1
            (seg,) = run.segments
            # up to where the last turn began, the tokens are what the template renders of the conversation
            history = [{"role": m.role, "content": m.content} for m in run.conversation[:-1]]
            tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.parameters}} for t in run.tools]
            whole = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
            assert tok.decode([*seg.prompt, *seg.ids])[: len(whole)] == whole
    assert unsplit >= 4  # a sample splits only when the model sampled a special token mid-turn


def test_a_segments_kv_versions_skip_observations_and_are_unknown_once_an_engine_could_not_tell():
    from tidal.rollout.episodes.multiturn import Segment

    seg = Segment(prompt=[1, 2])
    seg.add([5, 6], [-0.1, -0.2], [3, 4], [3, 3])  # sampled over version 3's KV (continue mode)
    seg.add([7])  # the environment's answer
    assert seg.versions == [3, 4, NO_VERSION] and seg.kv_versions == [3, 3, NO_VERSION]
    seg.add([8], [-0.3], [4], None)  # a turn from an engine that does not record KV versions
    seg.add([9])
    assert seg.kv_versions is None and seg.versions == [3, 4, NO_VERSION, 4, NO_VERSION]
