"""Sequence parallelism in the learner (`learner.parallel.sp`): one Trainer step on 2 gloo ranks (sp = 2,
Ulysses or ring) gives the loss and gradients of the same step on one rank, and the options that cannot
work are refused before training with errors that name the constraint.

The fixed batch (sp_rank.py): 3 GRPO groups of 4 samples sharing a prompt, packed several sequences to a
row over 3 micro-batches, some tokens masked out of the loss, half the samples drawn at temperature 0.7 /
top-k 40. At sp = 1 the learner packs each group's prompt once (tidal_varlen's shared-prefix layout); at
sp = 2 each sample carries its own prompt (a row split over ranks has no shared-prefix layout): the
logits are the same by construction, so the comparison also covers that.

Tolerance (fp32): the loss within 1e-6 relative (or 1e-7 absolute, for a loss near 0 whose terms of
size ~1 cancel), every gradient entry within 1e-5 x the largest gradient entry. Nothing differs but the order of floating-point sums: SDPA at sp = 1 against tidal-seqpar's tiled
online softmax (and its ring merge) at sp = 2, and each parameter's gradient summed over two ranks'
halves of the sequence. Measured: ~5e-7 x the largest entry (about 4 ulps at that scale); 1e-5 leaves
20x room for other BLAS paths and stays far below what a real mistake moves (a token scored twice or not
at all, a rank's gradient counted twice, a wrong mask: 1e-2 and more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tidal.core.errors import ConfigError
from tidal.core.testing import free_port
from tidal.integration.learner.parallel import check_parallel
from tidal.learner.config import ParallelConfig

RANK = Path(__file__).with_name("sp_rank.py")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sp") / "model", seed=5)  # Llama: 4 query / 2 KV heads


@pytest.fixture(scope="module")
def sinks_model(tmp_path_factory):
    """A tiny GPT-OSS (Hugging Face GptOss: attention sinks, its own MoE MLP), sinks away from 0."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, vocab_size=79,
                       layer_types=["full_attention"] * 2, max_position_embeddings=512, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    m = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_()
    path = tmp_path_factory.mktemp("sp") / "oss"
    m.save_pretrained(path)
    return path


def step(model: Path, out: Path, *args: str, world: int = 1, runs: list[dict] | None = None) -> tuple[dict, dict]:
    """Run sp_rank.py on `world` ranks; (metrics, gradients) of its one step. `runs`: several steps in the
    one launch (sp_rank.py --runs), each written to its own "out"; the first one's result is returned."""
    if runs is not None:
        args = (*args, "--runs", json.dumps(runs))
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(RANK), "--model", str(model), "--out", str(out), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, o in zip(procs, outs, strict=True):
        assert p.returncode == 0, o[-3000:]
    return result(Path(runs[0]["out"]) if runs else out)


def result(out: Path) -> tuple[dict, dict]:
    return json.loads(Path(f"{out}.json").read_text()), load_file(str(out))


def assert_same_step(one: tuple[dict, dict], two: tuple[dict, dict], dp: int = 1) -> None:
    (m1, g1), (m2, g2) = one, two
    for key in ("train/tokens", "train/sequences", "staleness/outside_support", *(("train/micro_batches",) * (dp == 1))):
        assert m1[key] == pytest.approx(m2[key], rel=1e-12), key
    # abs: a loss whose terms cancel (PPO's advantages sum to ~0 per group) is compared at their scale, ~1
    assert m2["loss/total"] == pytest.approx(m1["loss/total"], rel=1e-6, abs=1e-7)
    assert m2["train/entropy"] == pytest.approx(m1["train/entropy"], rel=1e-6)
    assert g1.keys() == g2.keys()
    scale = max(g.abs().max().item() for g in g1.values())
    assert scale > 0
    worst = max((g1[k] - g2[k]).abs().max().item() for k in g1)
    assert worst <= 1e-5 * scale, (worst, scale)


# every sp2 case below, stepped in one 2-rank launch (each case builds its own backend and SP groups): a
# launch of torch + transformers costs more than a step, and one per case cost ~30 s each on CI's 2 cores
SP2_CASES = [("ulysses", "single", "ppo", "grpo"), ("ring", "fsdp2", "ppo", "grpo"), ("ring", "single", "gspo", "grpo"),
             ("ulysses", "single", "ppo", "gae")]


@pytest.fixture(scope="module")
def one_rank(model, tmp_path_factory):
    """The sp = 1 step on one rank for every (loss, advantage) the tests use, in one launch."""
    folder = tmp_path_factory.mktemp("one")
    pairs = sorted({(loss, advantage) for *_, loss, advantage in SP2_CASES})
    runs = [{"loss": loss, "advantage": adv, "out": str(folder / f"{loss}-{adv}.safetensors")} for loss, adv in pairs]
    step(model, folder / "unused", runs=runs)
    return lambda loss, advantage: result(folder / f"{loss}-{advantage}.safetensors")


@pytest.fixture(scope="module")
def two_ranks(model, tmp_path_factory):
    """The sp = 2 step of every SP2_CASES case on two ranks, in one launch."""
    folder = tmp_path_factory.mktemp("two")
    runs = [{"sp_mode": mode, "backend": backend, "loss": loss, "advantage": adv, "sp": 2,
             "out": str(folder / f"{mode}-{backend}-{loss}-{adv}.safetensors")} for mode, backend, loss, adv in SP2_CASES]
    step(model, folder / "unused", runs=runs, world=2)
    return lambda case: result(folder / f"{'-'.join(case)}.safetensors")


@pytest.mark.parametrize(("mode", "backend", "loss", "advantage"), SP2_CASES)
def test_sp2_step_on_two_ranks_equals_one_rank(one_rank, two_ranks, mode, backend, loss, advantage):
    """ppo is a token mean; gspo's ratio is per sequence (the mean log-ratio of every token of it), so a
    sample split between the two ranks must still get its whole sequence's ratio; gae adds a critic whose
    per-token values (before the step, and in the loss) are gathered like the logprobs."""
    assert_same_step(one_rank(loss, advantage), two_ranks((mode, backend, loss, advantage)))


FOUR_CASES = [(2, "ring", 2), (4, "hybrid", 1)]


@pytest.fixture(scope="module")
def four_ranks(model, tmp_path_factory):
    """Each FOUR_CASES step on four ranks (fsdp2), in one launch."""
    folder = tmp_path_factory.mktemp("four")
    runs = [{"sp": sp, "sp_mode": mode, "backend": "fsdp2", "out": str(folder / f"{sp}-{mode}.safetensors")}
            for sp, mode, _ in FOUR_CASES]
    step(model, folder / "unused", runs=runs, world=4)
    return lambda sp, mode: result(folder / f"{sp}-{mode}.safetensors")


@pytest.mark.slow  # 4 gloo ranks on CI's 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize(("sp", "mode", "dp"), FOUR_CASES)
def test_four_ranks_equal_one_rank(one_rank, four_ranks, sp, mode, dp):
    """dp 2 x sp 2: the batch is split over the two SP groups by GRPO group, each group's rows over its
    two ranks (fsdp2 over all four). sp 4 "hybrid": Ulysses 2 x ring 2 (hybrid keeps both above 1).
    Losses, metrics and gradients are the whole batch's, each token counted once."""
    assert_same_step(one_rank("ppo", "grpo"), four_ranks(sp, mode), dp=dp)


def test_attention_sinks_under_sp2_equal_one_rank(sinks_model, tmp_path):
    """GPT-OSS passes its sinks to the attention function (`s_aux`): under sp they go through
    tidal-seqpar's sink-aware attention, whose sink gradient is exact (the sinks' gradients are compared
    with the rest)."""
    one = step(sinks_model, tmp_path / "one.safetensors")
    two = step(sinks_model, tmp_path / "two.safetensors", "--sp", "2", world=2)
    assert_same_step(one, two)
    assert any("sinks" in k and two[1][k].abs().max() > 0 for k in two[1])


LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("par", "world", "config", "kw", "says"), [
    (ParallelConfig(sp=3), 3, LLAMA, {}, "Ulysses degrees that work are [1, 2, 4]"),
    (ParallelConfig(sp=2), 3, LLAMA, {}, "multiple of it (dp x sp), but it has 3"),
    (ParallelConfig(sp=2, sp_mode="hybrid"), 2, LLAMA, {}, "needs a Ulysses degree u with 1 < u < sp"),
    (ParallelConfig(sp=2), 2, LLAMA, {"attn": "sdpa"}, "learner.backend.options.attn = 'sdpa' cannot attend over a split row"),
    (ParallelConfig(sp=2), 2, LLAMA, {"backend": "deepspeed"}, "not 'deepspeed'"),
    (ParallelConfig(sp=2), 2, {**LLAMA, "layer_types": ["sliding_attention", "full_attention"]}, {},
     "sliding-window attention layers"),
    (ParallelConfig(ep=2), 2, LLAMA, {}, 'needs learner.backend.name = "fsdp2"'),
    (ParallelConfig(sp=2, ep=2), 4, LLAMA, {"backend": "fsdp2"}, "together are not supported yet"),
])
def test_parallel_options_that_cannot_work_are_config_errors(par, world, config, kw, says):
    with pytest.raises(ConfigError, match="learner.parallel|backend") as e:
        check_parallel(par, world=world, config=config, **kw)
    assert says in str(e.value)


def test_degrees_that_fit_are_planned():
    from tidal.integration.learner.parallel import check_sequence_parallel

    assert check_sequence_parallel(ParallelConfig(sp=3, sp_mode="ring"), world=6, config=LLAMA) == (1, 3)
    assert check_sequence_parallel(ParallelConfig(sp=4, sp_mode="hybrid"), world=4, config=LLAMA) == (2, 2)
    assert check_sequence_parallel(ParallelConfig(sp=8, sp_mode="hybrid"), world=8, config=LLAMA) == (4, 2)
    assert check_sequence_parallel(ParallelConfig(sp=4), world=8, config=LLAMA) == (4, 1)  # KV heads replicated
