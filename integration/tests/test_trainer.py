"""The learner's step in one process: packing is exact, PPO with a critic and a KL-to-reference loss
train, and the exported Hugging Face folder holds the trained weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.core.config import PluginRef
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample, completion_logprobs, pack
from tidal.integration.learner.trainer import Trainer
from tidal.learner.checkpoint import export_hf
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("trainer") / "model", seed=11)


def toy(vocab: int, groups: int = 2, g: int = 4) -> list[Sample]:
    """Groups whose rewarded completion is [5, 6, 7] and unrewarded [8, 9]."""
    out = []
    for gi in range(groups):
        for k in range(g):
            comp = np.array([5, 6, 7] if k % 2 == 0 else [8, 9], np.int32)
            out.append(Sample(id=f"{gi}:{k}", group_id=str(gi), prompt=np.array([3, 4, 10 + gi], np.int32),
                              completion=comp, logprobs=np.full(len(comp), -4.0, np.float32),
                              versions=np.zeros(len(comp), np.int32), reward=float(k % 2 == 0),
                              loss_mask=np.ones(len(comp), bool)))
    return out


def logp_of(model, prompt, completion) -> float:
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(completion)])
        lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        return float(lp.gather(1, torch.tensor(completion)[:, None].long()).sum())


def test_packed_logprobs_equal_one_forward_per_sequence(model):
    m = AutoModelForCausalLM.from_pretrained(model).eval()
    rng = np.random.default_rng(0)
    samples = [Sample(id=str(i), group_id="g", prompt=rng.integers(3, 70, rng.integers(2, 9)).astype(np.int32),
                      completion=rng.integers(3, 70, rng.integers(1, 15)).astype(np.int32),
                      logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32), reward=0.0,
                      loss_mask=np.ones(1, bool)) for i in range(9)]
    micros = pack(samples, max_tokens=40)
    assert sorted(i for mi in micros for i in mi.index) == list(range(9)) and len(micros) > 1
    assert all(mi.tokens <= 40 for mi in micros)
    with torch.no_grad():
        for mi in micros:
            lps, _ = completion_logprobs(m(input_ids=mi.input_ids, position_ids=mi.position_ids, use_cache=False).logits, mi)
            for i, lp in zip(mi.index, lps, strict=True):
                s = samples[i]
                alone = torch.log_softmax(m(torch.from_numpy(np.concatenate([s.prompt, s.completion])[None]).long()).logits[0], -1)
                want = alone[len(s.prompt) - 1 : -1].gather(1, torch.from_numpy(s.completion)[:, None].long())[:, 0]
                assert (lp - want).abs().max() < 1e-5



def test_shared_prompt_rows_give_each_sequence_alone_logprobs_and_the_same_step(model):
    """A group's prompt once per row, then its completions (tidal_varlen): every completion's logprobs
    equal its prompt + completion run alone; a group too big for a row is split, repeating the prompt;
    a PPO step trains the same loss and gradients as plain packing, from fewer tokens."""
    from tidal.seqpar.hf import register_varlen_attention
    from tidal.seqpar.varlen import VarlenLayout

    m = AutoModelForCausalLM.from_pretrained(model, attn_implementation=register_varlen_attention()).eval()
    rng = np.random.default_rng(1)
    samples = []
    for g in range(3):
        prompt = rng.integers(3, 70, rng.integers(2, 9)).astype(np.int32)
        for k in range(5):
            t = int(rng.integers(1, 12))
            samples.append(Sample(id=f"{g}:{k}", group_id=str(g), prompt=prompt,
                                  completion=rng.integers(3, 70, t).astype(np.int32),
                                  logprobs=np.full(t, -3.0, np.float32), versions=np.zeros(t, np.int32),
                                  reward=float(k % 2), loss_mask=np.ones(t, bool)))
    micros = pack(samples, max_tokens=32, share_prefix=True)
    assert sorted(i for mi in micros for i in mi.index) == list(range(15))
    assert all(mi.tokens <= 32 for mi in micros)
    plain_tokens = sum(s.length for s in samples)
    assert sum(mi.tokens for mi in micros) < plain_tokens  # prompts are not repeated per sample
    with torch.no_grad():
        for mi in micros:
            lps, _ = completion_logprobs(m(input_ids=mi.input_ids, position_ids=mi.position_ids, use_cache=False,
                                           varlen_layout=mi.layout).logits, mi)
            for i, lp in zip(mi.index, lps, strict=True):
                s = samples[i]
                row = torch.from_numpy(np.concatenate([s.prompt, s.completion])[None]).long()
                alone = torch.log_softmax(m(row, varlen_layout=VarlenLayout.from_lengths([row.shape[1]])).logits[0], -1)
                want = alone[len(s.prompt) - 1 : -1].gather(1, torch.from_numpy(s.completion)[:, None].long())[:, 0]
                assert (lp - want).abs().max() < 1e-5

    def one_step(share: bool):
        torch.manual_seed(0)
        be = SingleBackend(str(model), BackendConfig(optim=OptimConfig(lr=1e-3)))
        trainer = Trainer(be, TrainConfig(micro_batch_tokens=32, share_prompts=share))
        assert trainer.share_prefix is share
        grads = {}
        trainer.before_update = lambda: grads.update({n: p.grad.clone() for n, p in be.model.named_parameters()
                                                      if p.grad is not None})
        return trainer.step(samples), grads

    shared, g_shared = one_step(True)
    plain, g_plain = one_step(False)
    assert shared["loss/total"] == pytest.approx(plain["loss/total"], abs=1e-6)
    assert g_shared.keys() == g_plain.keys()
    for name, g in g_shared.items():
        torch.testing.assert_close(g, g_plain[name], rtol=1e-4, atol=1e-6)


def test_ppo_with_a_critic_learns_the_toy_objective(model):
    cfg = BackendConfig(value_head=True, optim=OptimConfig(lr=3e-3))
    be = SingleBackend(str(model), cfg)
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo"), advantage=PluginRef(name="gae", options={"lam": 1.0})))
    batch = toy(be.model.config.vocab_size)
    start = logp_of(be.model, batch[0].prompt, batch[0].completion)
    values = [trainer.step(batch)["loss/value"] for _ in range(10)]
    end = logp_of(be.model, batch[0].prompt, batch[0].completion)
    assert end > start + 1.0, (start, end)
    assert values[-1] < values[0] * 0.5, values  # the critic learns the returns
    assert not any(n.startswith("value_head") for n, _ in be.named_weights())  # never published


def test_kl_to_reference_and_hf_export(model, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(model)
    be = SingleBackend(str(model), BackendConfig(optim=OptimConfig(lr=3e-3)))
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo", options={"kl_coef": 0.1})), reference=ref)
    batch = toy(be.model.config.vocab_size)
    first = trainer.step(batch)
    second = trainer.step(batch)
    assert first["kl/reference"] == 0.0  # policy == reference before the first update
    assert second["kl/reference"] != 0.0
    with pytest.raises(ValueError, match="reference model"):
        Trainer(be, TrainConfig(loss=PluginRef(name="ppo", options={"kl_coef": 0.1})))
    out = export_hf(tmp_path / "hf", be, model)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    mine = dict(be.named_weights())
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, mine[name]), name


def test_staleness_correction_and_gradient_checkpointing(model):
    """A staleness correction by name (decoupled PPO: proximal = the pre-step policy) reports its
    metrics; activation checkpointing changes memory, not the result."""
    batch = toy(80)
    runs = {}
    for ckpt in (False, True):
        be = SingleBackend(str(model), BackendConfig(grad_checkpointing=ckpt, optim=OptimConfig(lr=1e-3)))
        trainer = Trainer(be, TrainConfig(correction=PluginRef(name="decoupled_ppo", options={"cap": 2.0})))
        metrics = trainer.step(batch)
        runs[ckpt] = dict(be.named_weights())
    assert any(k.startswith("staleness/") and k != "staleness/mismatch_kl" for k in metrics), metrics
    assert metrics["staleness/mismatch_kl"] > 0  # behaviour logprobs (-4) differ from the model's
    assert max((runs[False][k] - runs[True][k]).abs().max().item() for k in runs[False]) < 1e-6


def test_step_rewards_reach_the_estimator_at_the_positions_the_environment_gave(model):
    """A multi-turn sample's process rewards travel on the wire (Trajectory.step_rewards at .step_ends),
    into the learner's samples, and into `grpo_process` at those completion positions; observation tokens
    (loss mask 0) get no advantage. `grpo` trains on the outcome alone and says so once."""
    from tidal.core import codec as _codec
    from tidal.core.arrays import Array
    from tidal.core.protocol import NO_VERSION, Trajectory

    def traj(i: int, step_rewards: list[float], outcome: float) -> Trajectory:
        # 2 turns: action [0, 3), observation [3, 5) (not trained), action [5, 8)
        mask = np.array([1, 1, 1, 0, 0, 1, 1, 1], np.uint8)
        return Trajectory(id=f"g:{i}", group_id="g", sample_index=i, task="t",
                          prompt_ids=Array.from_numpy(np.array([3, 4], np.int32)),
                          completion_ids=Array.from_numpy(np.arange(5, 13, dtype=np.int32)),
                          logprobs=Array.from_numpy(np.where(mask, -1.0, 0.0).astype(np.float32)),
                          versions=Array.from_numpy(np.where(mask, 0, NO_VERSION).astype(np.int32)),
                          reward=outcome, finish_reason="stop", loss_mask=Array.from_numpy(mask),
                          step_rewards=Array.from_numpy(np.array(step_rewards, np.float32)),
                          step_ends=Array.from_numpy(np.array([3, 8], np.int32)))

    codec = _codec.Codec()
    wire = [traj(0, [1.0, 0.0], 1.0), traj(1, [0.0, 0.0], 0.0), traj(2, [1.0, 1.0], 1.0), traj(3, [0.0, 1.0], 0.0)]
    samples = [Sample.from_trajectory(codec.decode(codec.encode(t))) for t in wire]  # through the wire format
    assert [s.step_ends.tolist() for s in samples] == [[3, 8]] * 4
    be = SingleBackend(str(model), BackendConfig(optim=OptimConfig(lr=1e-3)))
    trainer = Trainer(be, TrainConfig(advantage=PluginRef(name="grpo_process", options={"outcome_weight": 0.0})))
    adv, _ = trainer.advantages(samples)
    adv = torch.stack(adv)
    assert torch.all(adv[:, 3:5] == 0)  # observation tokens: no advantage
    # reward-to-go of normalised step rewards: step 1's tokens carry steps 1 and 2, step 2's only step 2
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    norm = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    assert torch.allclose(adv[:, 0], norm.sum(1), atol=1e-5) and torch.allclose(adv[:, 5], norm[:, 1], atol=1e-5)
    plain = Trainer(be, TrainConfig(advantage=PluginRef(name="grpo")))
    adv_plain, _ = plain.advantages(samples)  # outcome only: the same advantage on every trained token
    assert torch.allclose(adv_plain[0][:3], adv_plain[0][5:]) and plain.adv.warned_steps  # said once: rewards ignored
