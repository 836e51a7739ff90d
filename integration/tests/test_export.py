"""The trained policy, written out: a learner process stopped by SIGTERM (what `tidal run` sends it at
the end and on Ctrl-C) writes <run>/model, which transformers loads and which gives the learner's final
logprobs; `tidal export` of a kept checkpoint gives the same; keep_checkpoints keeps the newest N."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import torch

from tidal.core.arrays import Array
from tidal.core.protocol import Trajectory
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint
from tidal.learner.config import BackendChoice, BackendConfig, LearnerConfig, OptimConfig

pytestmark = pytest.mark.timeout(600)
G = 4


def _push_groups(ingest: str, publish: str, tok, n_groups: int) -> None:
    prompt, good, bad = tok.encode("3+4="), tok.encode("7\n"), tok.encode("8\n")
    with AckedPusher(ingest, publish, "producer", resend_after=1.0) as out:
        for gi in range(n_groups):
            for k in range(G):
                comp = good if k % 2 == 0 else bad
                out.send(Trajectory(
                    id=f"g{gi}:{k}", group_id=f"g{gi}", sample_index=k, task="arithmetic",
                    prompt_ids=Array.from_numpy(np.asarray(prompt, np.int32)),
                    completion_ids=Array.from_numpy(np.asarray(comp, np.int32)),
                    logprobs=Array.from_numpy(np.full(len(comp), -1.0, np.float32)),
                    versions=Array.from_numpy(np.zeros(len(comp), np.int32)),
                    reward=1.0 if comp is good else 0.0, finish_reason="stop", source="producer", group_size=G))
        out.flush(timeout=60)


def _logprobs(model, batch: list[list[int]]) -> torch.Tensor:
    """Per-token logprobs of a fixed batch of sequences (each scored on its own, no padding)."""
    out = []
    with torch.no_grad():
        for ids in batch:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0])
    return torch.cat(out)


def _tidal(*args: str) -> subprocess.CompletedProcess[str]:
    """`tidal ARGS` as a user types it: its own process."""
    return subprocess.run([sys.executable, "-m", "tidal.integration.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _export(capsys, *args: str) -> tuple[int, str]:
    """`tidal export ARGS` through the same entry point, in this process (a second interpreter would only
    import torch again): its exit status and what it wrote to stderr."""
    from tidal.integration.cli import main

    capsys.readouterr()
    rc = main(["export", *args])
    return rc, capsys.readouterr().err


def test_a_stopped_learner_writes_a_model_folder_that_transformers_loads_and_tidal_export_agrees(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from tidal.integration.learner.backends import SingleBackend
    from tidal.learner.checkpoint import load_checkpoint
    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    model_path = build_tiny_model(tmp_path / "base", seed=5)
    tok = load_tokenizer(model_path)
    run = tmp_path / "run"
    (run / "roles").mkdir(parents=True)
    ingest, serve, publish, announce = (free_endpoint() for _ in range(4))
    # the learner's config as `tidal run` writes it (roles/learner.json): what `tidal export` reads
    cfg = LearnerConfig(model=str(model_path), buffer=serve, publish=announce, checkpoint_dir=str(run / "checkpoints"),
                        checkpoint_every=2, keep_checkpoints=2, export_dir=str(run / "model"),
                        backend=BackendChoice(options=BackendConfig(optim=OptimConfig(lr=3e-3))))
    config = run / "roles" / "learner.json"
    config.write_bytes(msgspec.json.encode(cfg))
    log_path = run / "learner.log"
    buffer = subprocess.Popen(
        [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{run / "wal"}"', f"group_size={G}", f"batch_samples={G}"],
        stdout=open(run / "buffer.log", "w"), stderr=subprocess.STDOUT)
    learner = None
    try:
        _push_groups(ingest, publish, tok, 5)
        # until stopped (max_steps 0), as under `tidal run` when the driver ends the run or is interrupted
        learner = subprocess.Popen([sys.executable, "-m", "tidal.integration.learner", "--config", str(config),
                                    "weights.every=0"],
                                   stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while "step 5 " not in log_path.read_text():
            assert learner.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        os.killpg(learner.pid, signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        print(f"stop + checkpoint + export: {time.monotonic() - t0:.1f} s")
    finally:
        if learner is not None and learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
            learner.wait(timeout=30)
        buffer.terminate()
        buffer.wait(timeout=30)

    exported = run / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in exported.iterdir()}, sorted(p.name for p in exported.iterdir())
    assert "written to" in log_path.read_text()
    batch = [tok.encode(t) for t in ("3+4=7\n", "12+30=42\n", "9+9=18\n")]
    loaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    # the learner's final weights: its exit checkpoint (written from the same state, right before the export)
    final = SingleBackend(str(model_path), BackendConfig())
    progress = load_checkpoint(run / "checkpoints" / "latest", final)
    assert progress["step"] == 5
    final.model.eval()
    want = _logprobs(final.model, batch)
    start = _logprobs(AutoModelForCausalLM.from_pretrained(model_path).eval(), batch)
    assert (want - start).abs().max() > 1e-3, "the learner did not train: the test would prove nothing"
    assert (_logprobs(loaded, batch) - want).abs().max() <= 1e-5

    # keep_checkpoints = 2: the newest two steps (4 and the exit's 5) beside latest
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000004", "step-000005"]
    out = _tidal("export", str(run), "--checkpoint", "latest", "--out", str(tmp_path / "again"))
    assert out.returncode == 0, out.stderr
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert (_logprobs(again, batch) - want).abs().max() <= 1e-5
    rc, err = _export(capsys, str(run), "--checkpoint", "4")  # an older kept one: default folder <run>/model-step-000004
    assert rc == 0, err
    older = _logprobs(AutoModelForCausalLM.from_pretrained(run / "model-step-000004").eval(), batch)
    assert (older - want).abs().max() > 1e-6  # one step before the last
    rc, err = _export(capsys, str(run), "--checkpoint", "2")
    assert rc == 2 and "step 2" in err and "step-000004, step-000005" in err, err
    assert not (run / "model-step-000002").exists()
    assert json.loads((run / "checkpoints" / "step-000004" / "progress.json").read_text())["step"] == 4


def test_export_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    rc, err = _export(capsys, str(tmp_path))
    assert rc == 2 and "roles/learner.json" in err and "run folder" in err
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_checkpoint_is_read_whole_and_best_is_the_best_evaluated_kept_one(tmp_path):
    """checkpoint_weights reads torch.distributed.checkpoint's format (what fsdp2 ranks write) in one
    process; `best` picks, among the kept checkpoints, the version with the highest held-out accuracy in
    the run's metrics (an unevaluated one never), and says why when none was evaluated."""
    import torch.distributed.checkpoint as dcp

    from tidal.integration.export import find_checkpoint
    from tidal.integration.learner.backends import SingleBackend
    from tidal.learner.checkpoint import checkpoint_weights
    from tidal.rollout.tiny import build_tiny_model

    model_path = build_tiny_model(tmp_path / "base", seed=2)
    be = SingleBackend(str(model_path), BackendConfig())
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(0.01)
    sharded = tmp_path / "dcp"
    dcp.save(be.state_dict(), checkpoint_id=str(sharded))
    (sharded / "progress.json").write_text(json.dumps({"step": 1, "version": 1}))
    got = checkpoint_weights(sharded, model_path)
    mine = dict(be.named_weights())
    assert set(got) == set(mine) and all(torch.equal(got[k], mine[k]) for k in mine)

    run = tmp_path / "run"
    (run / "roles").mkdir(parents=True)
    (run / "roles" / "learner.json").write_bytes(msgspec.json.encode(
        LearnerConfig(model=str(model_path), checkpoint_dir=str(run / "checkpoints"))))
    for name, version in (("step-000010", 10), ("step-000020", 20), ("step-000030", 30), ("latest", 30)):
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "progress.json").write_text(json.dumps({"step": version, "version": version}))
    rows = [{"source": "controller", "step": v, "time": 0.0, "elapsed": float(v), "histograms": {},
             "scalars": {"eval/version": float(v), "eval/accuracy": acc}}
            for v, acc in ((0, 0.1), (10, 0.5), (15, 0.9), (20, 0.7), (30, 0.6))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert find_checkpoint(run, "best").name == "step-000020"  # 15 scored higher, but is not kept
    assert find_checkpoint(run, "latest").name == "latest" and find_checkpoint(run, "10").name == "step-000010"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] in (0, 15)))
    with pytest.raises(ValueError, match="no kept checkpoint .* was evaluated"):
        find_checkpoint(run, "best")


def test_the_driver_pins_the_best_checkpointed_version_and_export_uses_it(tmp_path, capsys):
    """pin_best (what the controller calls when an evaluation beats every earlier one) makes
    checkpoints/best a hard-linked copy of the kept checkpoint of that version; an unkept version pins
    nothing; best survives latest being rewritten; `tidal export --checkpoint best` reads it."""
    from tidal.integration.export import find_checkpoint
    from tidal.integration.learner.backends import SingleBackend
    from tidal.learner.best import pin_best
    from tidal.learner.checkpoint import keep_last, save_checkpoint
    from tidal.rollout.tiny import build_tiny_model

    model_path = build_tiny_model(tmp_path / "base", seed=3)
    be = SingleBackend(str(model_path), BackendConfig())
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    (run / "roles").mkdir(parents=True)
    (run / "roles" / "learner.json").write_bytes(msgspec.json.encode(
        LearnerConfig(model=str(model_path), checkpoint_dir=str(ckpts))))

    def checkpoint(v: int) -> None:  # what the learner does at checkpoint_every = 2, keep_checkpoints = 2
        with torch.no_grad():
            for p in be.model.parameters():
                p.add_(0.01)
        save_checkpoint(ckpts / "latest", be, {"step": v, "version": v})
        keep_last(ckpts, ckpts / "latest", v, 2)

    def best_version() -> int:
        return json.loads((ckpts / "best" / "progress.json").read_text())["version"]

    checkpoint(2)
    assert pin_best(ckpts, 2) == ckpts / "best" and best_version() == 2
    weights_at_2 = {k: t.detach().clone() for k, t in be.named_weights()}
    assert pin_best(ckpts, 3) is None and best_version() == 2  # 3 is not checkpointed: best stays
    checkpoint(4)
    checkpoint(6)  # latest rewritten, step-000002 dropped: best still holds version 2 whole
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "latest", "step-000004", "step-000006"]
    assert best_version() == 2 and find_checkpoint(run, "best") == ckpts / "best"
    rc, err = _export(capsys, str(run), "--checkpoint", "best", "--out", str(tmp_path / "best-model"))
    assert rc == 0, err
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "best-model").state_dict()
    shared = [k for k in weights_at_2 if k in exported]
    assert shared and all(torch.equal(exported[k], weights_at_2[k]) for k in shared)
    assert pin_best(ckpts, 4) is not None and best_version() == 4  # from step-000004
    assert pin_best(ckpts, 6) is not None and best_version() == 6  # from latest
    assert not (ckpts / ".best-tmp").exists() and not (ckpts / ".best-old").exists()
