"""The worker's single-turn scoring takes only real finite numbers from an environment's `score` (a
string such as "1.0" is a score_error naming the value, never a reward of 1.0); its domains are the listed
ones, each once, and a task naming an env plugin directly gets that env with its defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.core.config import Domain, PluginRef
from tidal.core.errors import ConfigError
from tidal.core.interfaces import GenerationResult, Task
from tidal.rollout.episodes.process import register_plugins
from tidal.rollout.worker.config import WorkerConfig
from tidal.rollout.worker.scoring import Domains, SampleError


def test_a_score_that_is_a_string_is_a_score_error_not_a_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    register_plugins(["envpool_plugins"])  # its `bad_score` env returns "1.0"
    domains = Domains(WorkerConfig(domains=[Domain(env=PluginRef(name="bad_score"))]), tokenizer=None)
    res = GenerationResult(request_id="r", completion_ids=[1, 2], logprobs=[0.0, 0.0], versions=[0, 0],
                           finish_reason="stop")
    with pytest.raises(SampleError) as e:
        domains.score("bad_score", Task(prompt="p"), res)
    assert e.value.reason == "score_error"
    assert "score() returned '1.0' (str), not a real number, for completion '1 2'" in str(e.value)


def test_a_domain_listed_twice_is_refused_when_the_worker_starts():
    cfg = WorkerConfig(domains=[Domain(env=PluginRef(name="arithmetic")),
                                Domain(env=PluginRef(name="countdown"), name="arithmetic")])
    with pytest.raises(ConfigError) as e:
        Domains(cfg, tokenizer=None)
    assert e.value.field == "domains[1].name" and "domains[1] and domains[0] are both named 'arithmetic'" in str(e.value)


def test_a_listed_domain_is_found_by_its_key_and_an_unlisted_task_is_an_env_plugin_with_its_defaults():
    cfg = WorkerConfig(domains=[Domain(name="hard", env=PluginRef(name="arithmetic", options={"level": 3}),
                                       reward=PluginRef(name="exact_match"))])
    assert cfg.domain("hard").env.options == {"level": 3} and cfg.domain("hard").reward is not None
    assert cfg.domain("countdown") == Domain(env=PluginRef(name="countdown"))
    domains = Domains(cfg, tokenizer=None)
    assert domains.env("hard").levels == [3] and domains.env("arithmetic").levels == [1]
    with pytest.raises(ConfigError) as e:  # an unlisted task that names no env plugin is refused by its field
        domains.env("no_such_env")
    assert e.value.field == "domains[no_such_env].env.name"
