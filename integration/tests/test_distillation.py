"""On-policy distillation through the learner's trainer: the student's reverse KL to a frozen teacher
falls on its own samples, a reward_weight adds the reward's gradient, and a teacher of another vocabulary
is refused before it loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.core.config import PluginRef
from tidal.core.errors import ConfigError
from tidal.core.protocol import SamplingParams
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.build import _load_reference
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, LearnerConfig, OptimConfig, TrainConfig
from tidal.rollout.tiny import ALPHABET, build_tiny_model

pytestmark = pytest.mark.timeout(120)
TINY = dict(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and a teacher of the same vocabulary, different weights (seeds)."""
    root = tmp_path_factory.mktemp("distill")
    return build_tiny_model(root / "student", seed=1, **TINY), build_tiny_model(root / "teacher", seed=2, **TINY)


def teacher_of(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path).requires_grad_(False)


def on_policy_batch(student: torch.nn.Module, groups: int = 4, g: int = 64, length: int = 6,
                    seed: int = 0) -> list[Sample]:
    """Completions the student samples itself at temperature 1 (full vocabulary), a group at a time, with
    their logprobs as the behaviour logprobs; rewards vary within each group so the reward advantage is
    not zero."""
    gen = torch.Generator().manual_seed(seed)
    vocab = student.config.vocab_size
    out = []
    with torch.no_grad():
        for gi in range(groups):
            prompt = torch.randint(3, vocab, (4,), generator=gen)
            ids, lps = prompt.repeat(g, 1), []
            for _ in range(length):
                logp = torch.log_softmax(student(ids).logits[:, -1].float(), -1)
                tok = torch.multinomial(logp.exp(), 1, generator=gen)
                lps.append(logp.gather(1, tok))
                ids = torch.cat([ids, tok], 1)
            lp = torch.cat(lps, 1).numpy().astype(np.float32)
            comp = ids[:, len(prompt):].numpy().astype(np.int32)
            out += [Sample(id=f"{gi}:{k}", group_id=str(gi), prompt=prompt.numpy().astype(np.int32),
                           completion=comp[k], logprobs=lp[k], versions=np.zeros(length, np.int32),
                           reward=float(k % 3 == 0), loss_mask=np.ones(length, bool),
                           sampling=SamplingParams(temperature=1.0)) for k in range(g)]
    return out


def reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, batch: list[Sample]) -> float:
    """Exact KL(student || teacher) of the full next-token distributions, averaged over the batch's
    completion positions."""
    total, n = 0.0, 0
    with torch.no_grad():
        for s in batch:
            ids = torch.from_numpy(np.concatenate([s.prompt, s.completion])).long()[None]
            at = slice(len(s.prompt) - 1, ids.shape[1] - 1)
            ls = torch.log_softmax(student(ids).logits[0, at].float(), -1)
            lt = torch.log_softmax(teacher(ids).logits[0, at].float(), -1)
            total += float((ls.exp() * (ls - lt)).sum())
            n += len(s.completion)
    return total / n


def test_distillation_lowers_the_reverse_kl_to_the_teacher(models):
    student_path, teacher_path = models
    teacher = teacher_of(teacher_path)
    torch.manual_seed(0)
    be = SingleBackend(str(student_path), BackendConfig(optim=OptimConfig(lr=3e-3)))
    batch = on_policy_batch(be.model)
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="distillation")), reference=teacher)
    before = reverse_kl(be.model, teacher, batch)
    reported = [trainer.step(batch)["kl/teacher_reverse"] for _ in range(4)]
    after = reverse_kl(be.model, teacher, batch)
    assert after < 0.8 * before, (before, after)  # about 0.66 x before
    # the loss's own sampled estimate of the same KL, on the first (on-policy) step
    assert reported[0] == pytest.approx(before, rel=0.5), (reported, before)


def test_reward_weight_adds_the_reward_gradient_through_the_trainer(models):
    """reward_weight = 0.5 changes the step's gradient by exactly half REINFORCE's on the reward
    advantage (the optimizer is not compared: Adam's first step is about sign(g) either way)."""
    student_path, teacher_path = models
    teacher = teacher_of(teacher_path)
    batch = on_policy_batch(AutoModelForCausalLM.from_pretrained(student_path), groups=2, g=4)

    def grads(loss: str, **options) -> dict[str, torch.Tensor]:
        be = SingleBackend(str(student_path), BackendConfig(optim=OptimConfig(lr=1e-3)))
        trainer = Trainer(be, TrainConfig(loss=PluginRef(name=loss, options=options)), reference=teacher)
        out: dict[str, torch.Tensor] = {}
        trainer.before_update = lambda: out.update(
            {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None})
        trainer.step(batch)
        return out

    plain, mixed, reward = grads("distillation"), grads("distillation", reward_weight=0.5), grads("reinforce")
    assert any((mixed[n] - plain[n]).abs().max() > 1e-6 for n in plain)
    for name, g in plain.items():
        torch.testing.assert_close(mixed[name], g + 0.5 * reward[name], rtol=1e-4, atol=1e-6)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(models, tmp_path):
    student_path, teacher_path = models
    other_size = build_tiny_model(tmp_path / "other_size", seed=2, alphabet=ALPHABET[:-5], **TINY)
    shuffled = build_tiny_model(tmp_path / "shuffled", seed=2, alphabet=ALPHABET[::-1], **TINY)  # same size
    for teacher, why in ((other_size, "vocab_size"), (shuffled, "tokenizer.json")):
        cfg = LearnerConfig(model=str(student_path), reference_model=str(teacher), device="cpu")
        with pytest.raises(ConfigError, match=why) as err:
            _load_reference(cfg, "auto")
        msg = str(err.value)
        assert f"learner.reference_model = {str(teacher)!r}" in msg and f"learner.model = {str(student_path)!r}" in msg
        assert err.value.field == "learner.reference_model"
    same = _load_reference(LearnerConfig(model=str(student_path), reference_model=str(teacher_path), device="cpu"),
                           "auto")
    assert not any(p.requires_grad for p in same.parameters())
