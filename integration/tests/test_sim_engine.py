"""The `simulated` engine that the pipeline and control-plane benches stand on: it generates at its
simulated pace, a paused engine holds its sequences without burning a core, and its options are checked
like any engine's."""

from __future__ import annotations

import time

import pytest

from tidal.core.errors import ConfigError
from tidal.core.interfaces import GenerationRequest, SamplingParams
from tidal.core.plugins import registry
from tidal.integration.sim import SimulatedEngine


def _results(engine: SimulatedEngine, n: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} results in {timeout} s"
        got += engine.poll(timeout=0.05)
    return got


def test_a_paused_engine_holds_its_sequences_idle_and_finishes_them_when_resumed():
    engine = SimulatedEngine(token_s=0.002, median_tokens=200, sigma=0.0, fetch_weights=False)
    try:
        engine.submit(GenerationRequest(request_id="r0", prompt_ids=[1, 2],
                                        sampling=SamplingParams(max_tokens=200, seed=1)))
        time.sleep(0.05)
        engine.pause()
        time.sleep(0.05)  # a step in progress ends
        steps, cpu = engine.load_state()["steps"], time.process_time()
        time.sleep(0.5)
        assert engine.load_state()["steps"] == steps  # nothing advances while paused
        assert time.process_time() - cpu < 0.2  # and the engine's thread sleeps: no spinning core
        assert engine.load_state()["running"] == 1.0
        engine.resume()
        (result,) = _results(engine, 1)
        assert result.request_id == "r0" and len(result.completion_ids) == 200
    finally:
        engine.close()


def test_an_idle_engine_sleeps_and_wakes_for_a_request():
    engine = SimulatedEngine(token_s=0.001, median_tokens=4, sigma=0.0, fetch_weights=False)
    try:
        cpu = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - cpu < 0.2
        engine.submit(GenerationRequest(request_id="r1", prompt_ids=[1], sampling=SamplingParams(max_tokens=8, seed=2)))
        (result,) = _results(engine, 1, timeout=2.0)
        assert len(result.completion_ids) == 4 and result.finish_reason == "stop"
    finally:
        engine.close()


def test_without_fetching_an_announced_version_is_held_at_once():
    from tidal.core.protocol import WeightsAvailable

    engine = SimulatedEngine(fetch_weights=False)
    try:
        assert engine.receive_weights(WeightsAvailable(version=3, transport="zmq", manifest=[])) == 3
        assert engine.version == 3
    finally:
        engine.close()


def test_its_options_are_checked_like_any_engines():
    with pytest.raises(ConfigError, match="no option 'token_ms'"):
        registry.check("engine", "simulated", {"token_ms": 20}, field="rollout.engine")
    with pytest.raises(ConfigError, match="fetch_weights"):
        registry.check("engine", "simulated", {"fetch_weights": "no"}, field="rollout.engine")
