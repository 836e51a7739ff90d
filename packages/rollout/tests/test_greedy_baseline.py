"""ReMax's greedy baseline member: an assignment whose metadata holds BASELINE_KEY = "greedy" has its last
sample decoded greedily by the real embedded engine (the same completion as a temperature-0 request, and
the same whatever that sample's seed); its trajectory alone keeps the key, is never trained (loss_mask 0)
and says it was sampled at temperature 0. Without the key nothing changes."""

from __future__ import annotations

import msgspec
import numpy as np

from tidal.core.arrays import Array
from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import BASELINE_KEY, Assignment, SamplingParams
from tidal.rollout.engines.embedded import EmbeddedEngine
from tidal.rollout.worker.results import iter_requests, trajectory_of

G = 4
PROMPT = [5, 6, 7, 8, 9]


def _assignment(**metadata: str) -> Assignment:
    return Assignment(group_id="g-0000003", prompt_ids=Array.from_list(PROMPT, "int32"), num_samples=G, task="toy",
                      sampling=SamplingParams(temperature=1.5, top_k=20, max_tokens=6, ignore_eos=True),
                      metadata={"level": "5", **metadata})


def _generate(engine: EmbeddedEngine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    return {r.request_id: list(r.completion_ids) for r in engine.generate(requests, timeout=60)}


def test_the_last_member_is_decoded_greedily_and_never_trained(tiny_model):
    a = _assignment(**{BASELINE_KEY: "greedy"})
    requests = list(iter_requests(a))
    assert [r.sampling.temperature for r in requests] == [1.5] * (G - 1) + [0.0]
    assert requests[-1].sampling.top_k == -1 and requests[0].sampling.top_k == 20
    engine = EmbeddedEngine(tiny_model, max_num_seqs=8)
    try:
        out = _generate(engine, requests)
        greedy = _generate(engine, [GenerationRequest(request_id="argmax", prompt_ids=PROMPT,
                                                      sampling=SamplingParams(temperature=0.0, max_tokens=6,
                                                                              ignore_eos=True, seed=12345))])
        results = {r.request_id: r for r in engine.generate(requests, timeout=60)}
    finally:
        engine.close()
    assert out[requests[-1].request_id] == greedy["argmax"]  # the argmax completion, whatever the seed
    trajectories = [trajectory_of(a, i, results[r.request_id], reward=float(i), source="w") for i, r in enumerate(requests)]
    base = trajectories[-1]
    assert base.metadata == {"level": "5", BASELINE_KEY: "greedy"} and base.sampling.temperature == 0.0
    assert base.loss_mask is not None and not base.loss_mask.numpy().any()
    assert base.loss_mask.shape == base.completion_ids.shape
    for traj in trajectories[:-1]:  # the sampled members: trained, their metadata and sampling as assigned
        assert traj.metadata == {"level": "5"} and traj.loss_mask is None and traj.sampling == a.sampling


def test_without_the_key_every_member_is_sampled_as_assigned():
    a = _assignment()
    requests = list(iter_requests(a))
    assert [msgspec.structs.replace(r.sampling, seed=None) for r in requests] == [a.sampling] * G
    assert len({r.sampling.seed for r in requests}) == G
    assert np.unique([r.request_id for r in requests]).size == G
