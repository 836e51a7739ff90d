"""One logprob contract: the learner recomputes each token's logprob under exactly the processing its
sampler used (temperature, top-k, top-p, carried by the trajectory), through the same function the
embedded engine samples with, and with Keep Sampling Mask renormalises over the very vocabulary the
sampler kept. Real engine, real learner backend and packing; fp32 throughout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.core.arrays import Array
from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import SamplingParams, Trajectory
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample, pack, token_logprobs
from tidal.learner.config import BackendConfig

pytestmark = pytest.mark.timeout(300)

PROCESSED = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=12)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """24 completions from the embedded engine at temperature 0.7, top-k 20, top-p 0.9 (half of them
    recording the kept vocabulary), as the learner receives them: Trajectory -> Sample."""
    from tidal.rollout.engines.embedded import EmbeddedEngine
    from tidal.rollout.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("contract") / "model", seed=3)
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(24):
        prompt = torch.randint(3, 60, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        sp = SamplingParams(temperature=PROCESSED.temperature, top_k=PROCESSED.top_k, top_p=PROCESSED.top_p,
                            max_tokens=PROCESSED.max_tokens, seed=100 + i, return_sampling_mask=i % 2 == 1,
                            ignore_eos=True)
        reqs.append(GenerationRequest(request_id=f"g{i // 4}:{i % 4}", prompt_ids=prompt, sampling=sp))
    with EmbeddedEngine(model, max_num_seqs=8) as eng:
        results = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
    samples = []
    for rq in reqs:
        res = results[rq.request_id]
        t = Trajectory(id=rq.request_id, group_id=rq.request_id.split(":")[0], sample_index=0, task="t",
                       prompt_ids=Array.from_numpy(np.asarray(rq.prompt_ids, np.int32)),
                       completion_ids=Array.from_numpy(np.asarray(res.completion_ids, np.int32)),
                       logprobs=Array.from_numpy(np.asarray(res.logprobs, np.float32)),
                       versions=Array.from_numpy(np.asarray(res.versions, np.int32)), reward=0.0,
                       finish_reason=res.finish_reason, sampling=rq.sampling,
                       sampling_mask=None if res.sampling_mask is None else Array.from_numpy(res.sampling_mask))
        samples.append(Sample.from_trajectory(t))
    return model, samples


def learner_logprobs(model, samples, **pack_kw) -> list[np.ndarray]:
    """Each sample's completion logprobs as the learner's step computes them (its backend's forward on
    packed rows, logits only at completion-predicting positions)."""
    be = SingleBackend(str(model), BackendConfig())
    out: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for micro in pack(samples, 64, be.device, **pack_kw):
            logits = be.forward(micro.input_ids, micro.position_ids, micro.layout, keep=micro.pred)
            lp, _ = token_logprobs(logits, micro)
            sizes = [t for _, _, t in micro.spans]
            for i, part in zip(micro.index, lp.split(sizes), strict=True):
                out[i] = part.numpy()
    return [out[i] for i in range(len(samples))]


@pytest.mark.parametrize("share_prefix", [False, True])
def test_learner_logprobs_equal_the_samplers_under_temperature_top_k_top_p(sampled, share_prefix):
    model, samples = sampled
    recomputed = learner_logprobs(model, samples, share_prefix=share_prefix)
    worst = max(float(np.abs(r - s.logprobs).max()) for r, s in zip(recomputed, samples, strict=True))
    assert worst <= 1e-5, worst
    assert sum(len(s.completion) for s in samples) >= 100  # enough tokens for the bound to mean something


def test_the_old_temperature_only_path_would_fail_the_contract(sampled):
    """Negative control: recomputing at the temperature alone (what the learner did before) misses the
    top-k/top-p renormalisation; the same tokens are off by far more than the bound."""
    model, samples = sampled
    plain = [Sample(**{**s.__dict__, "sampling": None, "kept": None}) for s in samples]
    old = learner_logprobs(model, plain, fallback=SamplingParams(temperature=PROCESSED.temperature))
    worst = max(float(np.abs(r - s.logprobs).max()) for r, s in zip(old, samples, strict=True))
    assert worst > 1e-2, worst


def test_keep_sampling_mask_renormalises_over_the_samplers_own_vocabulary(sampled):
    """With the kept vocabulary on the wire, the learner does not recompute the cut: told a different
    top-p, the masked samples still match exactly, the unmasked ones no longer do."""
    model, samples = sampled
    wrong = [Sample(**{**s.__dict__, "sampling": SamplingParams(temperature=PROCESSED.temperature, top_p=0.5)})
             for s in samples]
    recomputed = learner_logprobs(model, wrong)
    masked = [float(np.abs(r - s.logprobs).max()) for r, s in zip(recomputed, samples, strict=True) if s.kept is not None]
    unmasked = [float(np.abs(r - s.logprobs).max()) for r, s in zip(recomputed, samples, strict=True) if s.kept is None]
    assert len(masked) == len(unmasked) == 12
    assert max(masked) <= 1e-5 and max(unmasked) > 1e-2, (max(masked), max(unmasked))


def test_a_greedy_trajectory_is_refused_by_name(sampled):
    from tidal.core.config import PluginRef
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import TrainConfig

    model, samples = sampled
    be = SingleBackend(str(model), BackendConfig())
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo")))
    greedy = [Sample(**{**s.__dict__, "sampling": SamplingParams(temperature=0.0)}) for s in samples[:4]]
    with pytest.raises(ValueError, match=r"trajectory g0:0 was sampled greedily"):
        trainer.step(greedy)


def test_tokens_outside_the_learners_support_leave_the_loss_counted_never_as_inf(sampled):
    """The current policy's top-k/top-p support can exclude a token the sampler kept (its weights moved,
    or the cut fell the other way by the last bits): that token has no ratio under it. It is masked out
    and counted, and nothing becomes inf or NaN."""
    import math

    from tidal.core.config import PluginRef
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import TrainConfig

    model, samples = sampled
    be = SingleBackend(str(model), BackendConfig())
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo")))
    narrow = [Sample(**{**s.__dict__, "sampling": SamplingParams(temperature=0.7, top_k=1), "kept": None})
              for s in samples[:8]]
    m = trainer.step(narrow)
    assert 0.2 < m["staleness/outside_support"] < 1.0, m["staleness/outside_support"]
    assert all(math.isfinite(v) for v in m.values()), {k: v for k, v in m.items() if not math.isfinite(v)}
