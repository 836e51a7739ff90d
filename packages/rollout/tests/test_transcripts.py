"""The transcripts a rollout worker writes (tidal.rollout.worker.transcripts): which samples (every Nth group, every
failed one), their caps (texts cut, the file stopped at max_mb), and what an episode's record holds, from
real episodes run by the worker's episode driver on the tiny model."""

from __future__ import annotations

import json
import time

import pytest

from tidal.core.config import Domain, PluginRef
from tidal.core.interfaces import Task
from tidal.core.protocol import ChatMessage, SamplingParams
from tidal.rollout.episodes.local import LocalEpisodes
from tidal.rollout.episodes.multiturn import (
    EpisodeFailed,
    EpisodeRun,
    EpisodesConfig,
    MultiTurn,
    Seat,
    Segment,
    run_episodes,
)
from tidal.rollout.episodes.renderers import PlainRenderer
from tidal.rollout.tiny import load_tokenizer
from tidal.rollout.worker.transcripts import (
    TranscriptsConfig,
    TranscriptWriter,
    cut,
    episode_record,
    single_record,
)

SAMPLING = SamplingParams(temperature=1.0, max_tokens=6, stop=["\n"], seed=7)


@pytest.fixture(autouse=True)
def _plugins_importable(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # envpool_plugins, for the in-process host


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _single(i: int, text: str = "42") -> dict:
    return single_record("rollout-0", "arithmetic", f"g{i}", f"g{i}:0", "What is 6 x 7?", text, 1.0, [3, 4], "stop")


def test_every_nth_group_from_the_first_and_failures_always(tmp_path):
    w = TranscriptWriter(TranscriptsConfig(every=3, dir=str(tmp_path)), "rollout-0")
    taken = [w.take_group() for _ in range(7)]
    assert taken == [True, False, False, True, False, False, True]
    assert w.wants_failure()
    assert not TranscriptWriter(TranscriptsConfig(every=3, failed=False, dir=str(tmp_path)), "r").wants_failure()
    never = TranscriptWriter(TranscriptsConfig(every=0, dir=str(tmp_path)), "r")
    assert not any(never.take_group() for _ in range(5))
    nowhere = TranscriptWriter(TranscriptsConfig(), "r")  # no dir (a worker outside `tidal run`): nothing written
    assert not nowhere.take_group() and not nowhere.wants_failure() and not nowhere.write(_single(0))


def test_long_texts_are_cut_and_the_file_stops_at_max_mb(tmp_path, caplog):
    w = TranscriptWriter(TranscriptsConfig(dir=str(tmp_path), max_chars_per_message=50, max_mb=0.002), "rollout-0")
    assert w.write(_single(0, "x" * 500))
    (rec,) = _lines(tmp_path / "rollout-0.jsonl")
    answer = rec["messages"][1]["text"]
    assert answer.startswith("x" * 50) and answer.endswith("[450 more characters]") and len(answer) < 100
    with caplog.at_level("WARNING", logger="tidal.rollout.transcripts"):
        results = [w.write(_single(i)) for i in range(1, 40)]
    assert results[0] and not results[-1] and w.full
    assert (tmp_path / "rollout-0.jsonl").stat().st_size <= 2000
    assert len(_lines(tmp_path / "rollout-0.jsonl")) == w.written
    assert sum("rollout.transcripts.max_mb" in r.message for r in caplog.records) == 1  # said once
    w.close()
    assert cut("short", 50) == "short" and cut("abc", 0) == "abc"


def test_an_episode_with_tool_calls_step_rewards_and_versions():
    seg = Segment(prompt=[1, 2], versions=[4, 4, -1, 5], step_rewards=[0.0, 0.5])
    seg.finish = "stop"
    seat = Seat(segments=[seg], conversation=[ChatMessage(role="user", content="Convert 3 km to m"),
                                              ChatMessage(role="assistant", content="<call>unit_factor km m</call>"),
                                              ChatMessage(role="tool", content="<result>1000</result>", name="unit_factor"),
                                              ChatMessage(role="assistant", content="3000")])
    run = EpisodeRun(group_id="unitconv-0000003", index=1, id="unitconv-0000003:1", seats={"": seat},
                     turns=2, outcome=1.0, turn_versions=[4, 5])
    r = episode_record(run, "rollout-0", "unitconv")
    assert r["episode_id"] == "unitconv-0000003:1" and r["group_id"] == "unitconv-0000003"
    assert r["reward"] == 1.0 and r["version"] == 5 and r["versions"] == [4, 5] and not r["failed"]
    user, call, tool, answer = r["messages"]
    assert user == {"role": "user", "text": "Convert 3 km to m"}
    assert call["tool_calls"] == ["unit_factor"] and call["reward"] == 0.0 and call["version"] == 4
    assert tool["name"] == "unit_factor" and answer["reward"] == 0.5 and "tool_calls" not in answer
    failed = episode_record(run, "rollout-0", "unitconv", "timeout", "episode unitconv-0000003:1: stuck")
    assert failed["failed"] and failed["reward"] is None and failed["error_kind"] == "timeout"
    assert failed["finish"] == "failed"


def test_real_episodes_finished_and_failed(tiny_model, tmp_path):
    from tidal.rollout.engines.embedded import EmbeddedEngine

    tok = load_tokenizer(tiny_model)
    engine = EmbeddedEngine(str(tiny_model), max_num_seqs=8, seed=0)
    try:
        domains = [Domain(env=PluginRef(name="counting", options={"turns": 3})),
                   Domain(env=PluginRef(name="raising_step"))]
        pool = LocalEpisodes(domains, plugins=["envpool_plugins"])
        (run,) = run_episodes(engine, tok, pool, "counting", [Task(prompt="task 1", domain="counting")], SAMPLING,
                              EpisodesConfig(max_tokens=200), lambda: PlainRenderer(tok), timeout=120)
        assert run is not None
        r = episode_record(run, "rollout-0", "counting")
        actions = [m for m in r["messages"] if m["role"] == "assistant"]
        assert len(actions) == 3 and [m["reward"] for m in actions] == run.segments[0].step_rewards
        assert all(m["version"] == 0 for m in actions) and r["reward"] == run.outcome
        assert r["messages"][0]["text"].startswith("task 1: count from 1 to 3")

        failure = _fail_one(engine, tok, pool)
        assert failure.episode_id == "local-x:0" and failure.reason
    finally:
        engine.close()


def _fail_one(engine, tok, pool) -> EpisodeFailed:
    """An episode of `raising_step` to its failure: the EpisodeFailed names the episode."""
    import numpy as np

    from tidal.core.arrays import Array
    from tidal.core.protocol import Assignment

    mt = MultiTurn(EpisodesConfig(max_tokens=200), pool, engine, tok, lambda: PlainRenderer(tok))
    mt.start(Assignment(group_id="local-x", prompt_ids=Array.from_numpy(np.zeros(0, np.int32)), num_samples=1,
                        task="raising_step", sampling=SAMPLING, prompt="task 1"), Task(prompt="task 1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            for reply in pool.poll(timeout=0):
                mt.on_reply(reply)
            for res in engine.poll(timeout=0.01):
                mt.on_result(res)
        except EpisodeFailed as e:
            record = episode_record(mt.runs[e.episode_id], "rollout-0", "raising_step", e.reason, str(e))
            assert record["failed"] and "cannot parse action" in record["error"]
            assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
            return e
    raise AssertionError("the raising episode did not fail within 60 s")


def test_a_single_turn_sample_that_could_not_be_scored():
    r = single_record("rollout-0", "arithmetic", "g1", "g1:0", "What is 6 x 7?", "forty-two", None, [1], "stop",
                      "reward_error", "group g1: the reward was nan")
    assert r["failed"] and r["reward"] is None and r["finish"] == "failed" and r["error_kind"] == "reward_error"
    assert r["messages"][1] == {"role": "assistant", "text": "forty-two", "version": 1}


def test_a_folder_it_cannot_write_stops_the_transcripts_not_the_worker(tmp_path, caplog):
    (tmp_path / "taken").write_text("a file where the folder should be")
    w = TranscriptWriter(TranscriptsConfig(dir=str(tmp_path / "taken" / "samples")), "rollout-0")
    with caplog.at_level("ERROR", logger="tidal.rollout.transcripts"):
        assert not w.write(_single(0)) and not w.write(_single(1))
    assert w.full and sum("cannot write" in r.message for r in caplog.records) == 1
