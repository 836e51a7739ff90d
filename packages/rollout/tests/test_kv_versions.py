"""Per-token KV versions outside the embedded engine (whose are checked in test_embedded_engine): the vLLM
adapter's bookkeeping alone (no vLLM needed): each attempt's tokens carry the version the attempt started
under, so a request carried across an update in "continue" mode reports its old KV, and a recomputed attempt
its new one; and the worker's trajectory keeps them (None when the engine could not tell)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tidal.core.arrays import Array
from tidal.core.interfaces import GenerationRequest, GenerationResult
from tidal.core.protocol import Assignment
from tidal.rollout.engines.vllm_engine import VLLMEngine, _Pending
from tidal.rollout.worker.results import trajectory_of


def _completion(ids, spans):
    lp = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
    return SimpleNamespace(token_ids=ids, logprobs=lp, weight_versions=spans)


def test_each_attempts_tokens_carry_the_version_its_kv_was_built_with():
    eng = object.__new__(VLLMEngine)  # only the bookkeeping: no vLLM behind it
    eng._version = 4
    pend = _Pending(req=GenerationRequest(request_id="r", prompt_ids=[1, 2]), prompt=[1, 2])
    # continue mode: started under 3, an update to 4 landed after the first two tokens
    spans = [SimpleNamespace(start=0, end=2, version=3), SimpleNamespace(start=2, end=4, version=4)]
    eng._absorb(pend, _completion([5, 6, 7, 8], spans), prompt_len=2, kv_floor=3)
    assert pend.versions == [3, 3, 4, 4] and pend.kv_versions == [3, 3, 3, 3]
    # a recomputed attempt (prompt + kept tokens prefilled again under 4): its KV is version 4's
    eng._absorb(pend, _completion([9], [SimpleNamespace(start=0, end=1, version=4)]), prompt_len=6, kv_floor=4)
    assert pend.versions == [3, 3, 4, 4, 4] and pend.kv_versions == [3, 3, 3, 3, 4]


def test_the_worker_trajectory_keeps_the_engines_kv_versions():
    a = Assignment(group_id="g-0000001", prompt_ids=Array.from_numpy(np.array([1, 2], np.int32)), num_samples=2,
                   task="toy")
    res = GenerationResult(request_id="r", completion_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[3, 4],
                           kv_versions=[3, 3], finish_reason="stop")
    t = trajectory_of(a, 0, res, 1.0, "rollout-0")
    assert t.kv_versions is not None and t.kv_versions.numpy().tolist() == [3, 3]
    assert t.kv_versions.dtype == "int32"
    res.kv_versions = None  # an engine that cannot tell
    assert trajectory_of(a, 0, res, 1.0, "rollout-0").kv_versions is None
