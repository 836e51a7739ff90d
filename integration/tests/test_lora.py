"""LoRA (`learner.lora`): only the adapters train and hold optimizer state, the generators are sent the
adapters alone (a real zmq weight transfer) and give the merged model's logprobs, checkpoints hold the
adapters and resume bit for bit, and what cannot train adapters yet is refused by name."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from tidal.core.errors import ConfigError
from tidal.core.interfaces import GenerationRequest
from tidal.core.plugins import registry
from tidal.core.protocol import SamplingParams
from tidal.integration.learner.checks import check_lora
from tidal.integration.learner.trainer import Trainer
from tidal.learner.checkpoint import load_checkpoint, save_checkpoint
from tidal.learner.config import (
    BackendChoice,
    BackendConfig,
    LearnerConfig,
    LoraOptions,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from tidal.rollout.engines.embedded import EmbeddedEngine, EngineError
from tidal.rollout.engines.logprobs import teacher_forced_logprobs

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the backend tests' helpers are not importable
from learner_rank import batch  # their synthetic batches
from test_learner_backends import max_diff, run

pytestmark = pytest.mark.timeout(300)
LORA = LoraOptions(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora") / "model", seed=5)


def backend(model: Path, lora: LoraOptions | None = LORA, lr: float = 1e-2):
    return registry.create("train_backend", "single", str(model), BackendConfig(optim=OptimConfig(lr=lr)),
                           **({"lora": lora} if lora else {}))


@pytest.fixture(scope="module")
def trained(model):
    """A LoRA backend after 3 steps (lr 1e-2: the adapters move well away from B = 0), and the base
    weights it started from."""
    be = backend(model)
    base = {n: t.clone() for n, t in be.export_weights()}
    trainer = Trainer(be, TrainConfig(micro_batch_tokens=64))
    vocab = be._module().config.vocab_size
    grads: dict[str, bool] = {}
    trainer.before_update = lambda: grads.update((n, p.grad is not None) for n, p in be.model.named_parameters())
    for step in range(3):
        trainer.step(batch(step, vocab))
    return be, base, grads


def test_only_the_adapters_get_gradients_and_optimizer_state(trained):
    be, base, grads = trained
    with_grad = {n for n, g in grads.items() if g}
    assert with_grad and all(".lora_A." in n or ".lora_B." in n for n in with_grad)
    assert len(with_grad) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    # the base weights did not move; the merged ones did
    params = dict(be.model.named_parameters())
    frozen = [n for n in params if "base_layer" in n or "embed_tokens" in n or "norm" in n or "lm_head" in n]
    assert frozen and not any(params[n].requires_grad for n in frozen)
    merged = dict(be.export_weights())
    assert merged.keys() == base.keys()
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-3
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    # AdamW's state (exp_avg, exp_avg_sq) is the adapters' size, r * (in + out) per projection: 5.2 % of
    # full fine-tuning's on this 2-layer, 128-wide model at rank 4 (the demo's figure is in the note)
    state = sum(v.numel() for st in be.optimizer.state.values() for v in st.values() if v.dim() > 0)
    shapes = [t.shape for n, t in base.items() if n.endswith("proj.weight")]
    assert state == 2 * sum(LORA.rank * (o + i) for o, i in shapes)
    assert state / (2 * sum(t.numel() for t in base.values())) < 0.06


def test_the_adapter_payload_gives_the_merged_models_logprobs_in_the_embedded_engine(trained, model):
    """Adapters sent alone over the zmq transport (as the learner's publisher sends them), merged by the
    engine: its sampled tokens' logprobs equal a forward of PEFT's own merge (merge_and_unload) <= 1e-5."""
    from tidal.weight_sync import WeightSender

    be, base, _ = trained
    reference = copy.deepcopy(be.model).merge_and_unload().eval()
    reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=[5 + i, 9, 14, 20 + i],
                              sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=100 + i)) for i in range(8)]
    with EmbeddedEngine(model, max_num_seqs=8) as eng, \
            WeightSender("zmq", lora_only=True, lora_scale=LORA.scale) as sender:
        before = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
        ann = sender.send(list(be.named_weights()), 1)
        assert ann.lora_only and ann.lora_scale == LORA.scale
        assert eng.receive_weights(ann) == 1
        after = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
        # a second version merges into the same base (versions replace, they never add up)
        assert eng.receive_weights(sender.send(list(be.named_weights()), 2)) == 2
        again = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
    worst = max((teacher_forced_logprobs(reference, rq.prompt_ids, after[rq.request_id].completion_ids, rq.sampling)
                 - torch.tensor(after[rq.request_id].logprobs)).abs().max().item() for rq in reqs)
    assert worst <= 1e-5, worst
    assert all(set(r.versions) == {1} for r in after.values())
    assert [again[k].logprobs for k in sorted(again)] == [after[k].logprobs for k in sorted(after)]
    assert [before[k].logprobs for k in sorted(before)] != [after[k].logprobs for k in sorted(after)]
    dense = sum(t.numel() * t.element_size() for t in base.values())
    adapters = sum(t.numel() * t.element_size() for _, t in be.named_weights())
    assert sum(ann.bucket_sizes) == adapters and adapters / dense < 0.06  # 5.2 % here; the demo's is in the note


def test_a_payload_that_does_not_fit_is_refused_and_the_weights_stay(trained, model):
    be, _, _ = trained
    adapters = list(be.named_weights())
    with EmbeddedEngine(model, max_num_seqs=2) as eng:
        with pytest.raises(EngineError, match="only one of lora_A / lora_B"):
            eng.update_weights(adapters[:1], 1, lora_scale=2.0)
        with pytest.raises(EngineError, match="without their scale"):
            eng.update_weights(adapters, 1, lora_scale=0.0)
        bad = [(n, torch.zeros(4, 7)) if n.endswith("layers.0.self_attn.q_proj.lora_A.weight") else (n, t)
               for n, t in adapters]
        with pytest.raises(EngineError, match="does not fit its weight"):
            eng.update_weights(bad, 1, lora_scale=2.0)
        assert eng.load_state()["version"] == 0


@pytest.mark.slow  # three learner processes, ~35 s
def test_resume_from_a_lora_checkpoint_is_bit_identical(model, tmp_path):
    """2 steps, checkpoint (the adapters and their optimizer state only), kill -9; a new process loads it
    and trains 1 step == 3 uninterrupted steps, bit for bit."""
    run("single", model, tmp_path / "straight.safetensors", "--steps", "3", "--lora", "4")
    run("single", model, tmp_path / "first.safetensors", "--steps", "2", "--lora", "4", "--save",
        str(tmp_path / "ckpt"), "--die-after-save", code=-9)
    held = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)["model"]
    assert held and all("lora_" in n for n in held)  # the adapters alone: the base is the model folder
    run("single", model, tmp_path / "resumed.safetensors", "--steps", "1", "--lora", "4", "--load",
        str(tmp_path / "ckpt"))
    assert max_diff(tmp_path / "straight.safetensors", tmp_path / "resumed.safetensors") == 0.0
    # a checkpoint of other adapters, or of full fine-tuning, is refused by name
    with pytest.raises(ValueError, match="does not hold the adapters learner.lora"):
        load_checkpoint(tmp_path / "ckpt", backend(model, LoraOptions(rank=4, target_modules=["q_proj"])))
    full = backend(model, None)
    save_checkpoint(tmp_path / "full", full, {"step": 0})
    with pytest.raises(ValueError, match="or by full fine-tuning"):
        load_checkpoint(tmp_path / "full", backend(model))


@pytest.mark.parametrize(("change", "match"), [
    ({"backend": BackendChoice(name="fsdp2")}, "'fsdp2' backend"),
    ({"parallel": ParallelConfig(sp=2)}, "sequence or expert parallelism"),
])
def test_what_cannot_train_adapters_yet_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        check_lora(LearnerConfig(model="m", lora=LORA, **change), world=1)
    with pytest.raises(ConfigError, match="2 learner ranks"):
        check_lora(LearnerConfig(model="m", lora=LORA), world=2)
    check_lora(LearnerConfig(model="m", **change), world=2)  # without lora: not this check's business


@pytest.mark.parametrize(("targets", "match"), [(["q_proj", "wq"], r"\['wq'\], which this model does not have"),
                                                (["embed_tokens"], "not Linear layers")])
def test_targets_that_are_missing_or_not_linear_are_refused(model, targets, match):
    with pytest.raises(ConfigError, match=match):
        backend(model, LoraOptions(rank=2, target_modules=targets))


def test_a_lora_checkpoint_exports_as_the_merged_model(trained, model, tmp_path):
    """`tidal export` of a LoRA run: the checkpoint's adapters merged into the starting model's weights, the
    same model the learner's own export writes (PEFT's merge, layer by layer)."""
    import msgspec
    from safetensors.torch import load_file

    from tidal.integration.export import export_run

    be, _, _ = trained
    run_dir = tmp_path / "run"
    (run_dir / "roles").mkdir(parents=True)
    cfg = LearnerConfig(model=str(model), lora=LORA, checkpoint_dir=str(run_dir / "checkpoints"))
    (run_dir / "roles" / "learner.json").write_bytes(msgspec.json.encode(cfg))
    save_checkpoint(run_dir / "checkpoints" / "latest", be, {"step": 3, "version": 3})
    out = load_file(str(export_run(run_dir, "latest") / "model.safetensors"))
    live = dict(be.export_weights())
    assert set(live) <= set(out) and max((out[k] - live[k]).abs().max().item() for k in live) <= 1e-6


@pytest.mark.slow  # a whole tidal run, ~40 s
def test_a_lora_run_sends_only_adapters_and_writes_the_merged_model(model, tmp_path, tidal_cli):
    """`tidal run` with learner.lora and the embedded engine: the worker applies every version it is sent
    (adapters alone, a few percent of the model's bytes), the checkpoint holds the adapters, and the run's
    model folder is the merged policy, which differs from the starting model only in the adapted layers."""
    import json
    import os
    import re

    from safetensors.torch import load_file

    from tidal.rollout.tiny import build_tiny_model

    # the random tiny model earns no reward on the drill, so GRPO would give no gradient: distillation to
    # another random model of the same vocabulary does, at every token
    teacher = build_tiny_model(tmp_path / "teacher", seed=9)
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run((model, dict(os.environ)), run_dir, "workers=1", "budget.versions=6", "eval.every=0",
                            "learner.lora.rank=4", "learner.lora.alpha=8", "learner.backend.options.optim.lr=1e-2",
                            'learner.lora.target_modules=["q_proj","v_proj"]', "learner.checkpoint_every=3",
                            'learner.train.loss={name="distillation"}', f'learner.reference_model="{teacher}"')
    assert rc == 0, out[-4000:] + tidal_cli.logs(run_dir)
    assert json.loads((run_dir / "final.json").read_text())["versions"] == 6
    worker = (run_dir / "logs" / "rollout-0.log").read_text()
    applied = [int(v) for v in re.findall(r"weights version (\d+) applied", worker)]
    assert applied and applied[-1] >= 4 and "rejected" not in worker, worker[-3000:]
    sent = [json.loads(line)["scalars"]["weights/bytes"] for line in (run_dir / "metrics.jsonl").open()
            if '"weights/bytes"' in line]
    dense = (model / "model.safetensors").stat().st_size
    assert sent and max(sent) < 0.03 * dense, (sent, dense)
    held = torch.load(run_dir / "checkpoints" / "latest" / "state.pt", weights_only=True)["model"]
    assert held and all("lora_" in n for n in held)
    base, trained = load_file(str(model / "model.safetensors")), load_file(str(run_dir / "model" / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], trained[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


def test_adapters_get_gradients_under_gradient_checkpointing(model):
    """With grad_checkpointing the frozen embeddings would cut every checkpointed segment off the graph (no
    adapter gradient at all); the backend makes their output require a gradient."""
    be = registry.create("train_backend", "single", str(model), BackendConfig(grad_checkpointing=True), lora=LORA)
    trainer = Trainer(be, TrainConfig(micro_batch_tokens=64))
    grads: dict[str, float] = {}
    trainer.before_update = lambda: grads.update(
        (n, float(p.grad.abs().sum())) for n, p in be.model.named_parameters() if p.grad is not None)
    trainer.step(batch(0, be._module().config.vocab_size))
    b = [n for n in grads if ".lora_B." in n]
    assert len(b) == 14 and all(grads[n] > 0 for n in b), grads
