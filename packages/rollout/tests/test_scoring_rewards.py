"""The worker's single-turn scoring takes only real finite numbers from an environment's `score` (a
string such as "1.0" is a score_error naming the value, never a reward of 1.0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.core.config import PluginRef
from tidal.core.interfaces import GenerationResult, Task
from tidal.rollout.episodes.process import register_plugins
from tidal.rollout.worker.config import WorkerConfig
from tidal.rollout.worker.scoring import Domains, SampleError


def test_a_score_that_is_a_string_is_a_score_error_not_a_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    register_plugins(["envpool_plugins"])  # its `bad_score` env returns "1.0"
    domains = Domains(WorkerConfig(envs=[PluginRef(name="bad_score")]), tokenizer=None)
    res = GenerationResult(request_id="r", completion_ids=[1, 2], logprobs=[0.0, 0.0], versions=[0, 0],
                           finish_reason="stop")
    with pytest.raises(SampleError) as e:
        domains.score("bad_score", Task(prompt="p"), res)
    assert e.value.reason == "score_error"
    assert "score() returned '1.0' (str), not a real number, for completion '1 2'" in str(e.value)
