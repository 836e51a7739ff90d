"""Train backends against each other and against themselves across a checkpoint, with real processes
(2 gloo ranks for fsdp2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tidal.core.testing import free_port

RANK = Path(__file__).with_name("learner_rank.py")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("learner") / "model", seed=5)


def run(backend: str, model: Path, out: Path, *args: str, world: int = 1, code: int = 0) -> None:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(RANK), "--backend", backend, "--model", str(model),
                                       "--out", str(out), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=500)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, o in zip(procs, outs, strict=True):
        assert p.returncode == code, o[-3000:]


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.fixture(scope="module")
def single_run(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "single.safetensors"
    run("single", model, out)
    return out


# DeepSpeed's two (about 90 s with its first-use C++ build) run in the slow tier, which CI runs too
@pytest.mark.parametrize("backend", ["fsdp2", "single", pytest.param("deepspeed2", marks=pytest.mark.slow),
                                     pytest.param("deepspeed3", marks=pytest.mark.slow)])
def test_two_ranks_match_one(model, single_run, tmp_path, backend):
    """Same batches, same seed, 3 AdamW steps (lr 1e-3, warmup + cosine), fp32, each rank given half of
    each batch. Tolerance 1e-5 absolute (1 % of one step's largest update): the ranks' gradients are
    reduced in another order than one process sums them (fp32 differences ~1e-7 relative), and Adam's
    per-element m / sqrt(v) magnifies those for elements whose gradients are near zero. Measured: ~3e-6.
    deepspeed2 / deepspeed3 are ZeRO stages 2 and 3 (DeepSpeed compiles a small C++ op on first use).
    single on 2 ranks is plain data parallelism (`tidal run --nproc 2` with the default backend): the
    trainer averages the replicas' gradients, and every rank ends with the same weights as one process."""
    run(backend, model, tmp_path / f"{backend}.safetensors", "--every-rank", world=2)
    assert max_diff(single_run, tmp_path / f"{backend}.safetensors") <= 1e-5
    if backend == "single":  # each replica's own weights, not only rank 0's (the one that publishes)
        assert max_diff(tmp_path / "single.safetensors", tmp_path / "single.safetensors.rank1") == 0.0


@pytest.mark.parametrize(("backend", "world"), [("single", 1),
                                               # 2 ranks: ~40 s, in the slow tier (the default one is at its budget)
                                               pytest.param("fsdp2", 2, marks=pytest.mark.slow)])
def test_resume_is_bit_identical(model, single_run, tmp_path, backend, world):
    """k=2 steps, checkpoint, kill -9, new processes load it and train 1 step == 3 uninterrupted steps,
    bit for bit. (single: the 3 uninterrupted steps are `single_run`'s, one process launch fewer.)"""
    straight = single_run if backend == "single" else tmp_path / "straight.safetensors"
    if backend != "single":
        run(backend, model, straight, "--steps", "3", world=world)
    run(backend, model, tmp_path / "first.safetensors", "--steps", "2", "--save", str(tmp_path / "ckpt"),
        "--die-after-save", world=world, code=-9)
    assert (tmp_path / "ckpt" / "progress.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    run(backend, model, tmp_path / "resumed.safetensors", "--steps", "1", "--load", str(tmp_path / "ckpt"), world=world)
    assert max_diff(straight, tmp_path / "resumed.safetensors") == 0.0


def test_a_rank_with_an_empty_share_keeps_in_step(model, tmp_path):
    """One group for two fsdp2 ranks: rank 1 gets nothing each step and still joins every collective;
    the result equals single on the same batches."""
    run("single", model, tmp_path / "one.safetensors", "--groups", "1")
    run("fsdp2", model, tmp_path / "two.safetensors", "--groups", "1", world=2)
    assert max_diff(tmp_path / "one.safetensors", tmp_path / "two.safetensors") <= 1e-5
