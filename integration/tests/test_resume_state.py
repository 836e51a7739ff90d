"""What a resumed run continues from (tidal.integration.resume), without processes: the group numbering
journal, the buffer's WAL read back, the depth gate rebuilt, the evaluation history, the driver's lock,
and a controller built on a resume point."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from tidal.buffer import wal
from tidal.buffer.store import encode_trajectory
from tidal.core.channels import dealer
from tidal.core.protocol import Assignment, WorkRequest
from tidal.core.testing import make_trajectory
from tidal.integration.cli import main
from tidal.integration.controller import Controller
from tidal.integration.recipe import load_recipe
from tidal.integration.resume import (
    NUMBERING,
    Numbering,
    NumberingJournal,
    ResumePoint,
    RunFolderBusy,
    check_resumable,
    eval_history,
    group_number,
    hold_lock,
    load_numbering,
    resume_point,
    scan_wal,
)
from tidal.rollout.tiny import build_char_tokenizer

RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"


def _sample(gid: str, k: int):
    t = make_trajectory(k, completion_len=4)
    t.group_id, t.id = gid, f"{gid}:{k}"
    return t


def _wal(path: Path, groups: list[str], served: dict[str, list[str]], consumed: list[str], size: int = 2) -> None:
    log = wal.WriteAheadLog(path)
    log.replay()
    for gid in groups:
        log.append(wal.PutGroup([encode_trajectory(_sample(gid, k)) for k in range(size)]))
    for batch, gids in served.items():
        log.append(wal.Serve(batch, 0, 1, [f"{g}:{k}" for g in gids for k in range(size)]))
    for batch in consumed:
        log.append(wal.Consume(batch))
    log.close()


def test_group_numbers_are_read_from_sample_ids():
    assert group_number("arithmetic-0000042:3") == 42
    assert group_number("my-domain-2-0000007:0") == 7
    assert group_number("traj-x") is None


def test_the_numbering_journal_keeps_its_last_whole_line(tmp_path):
    j = NumberingJournal(tmp_path / NUMBERING)
    for n in range(1, 6):
        j.record(Numbering(next_group=n, tasks={"a": n + 1}))
    j.close()
    with open(tmp_path / NUMBERING, "ab") as f:
        f.write(b'{"next_group": 9')  # a kill mid-write
    assert load_numbering(tmp_path / NUMBERING) == Numbering(next_group=5, tasks={"a": 6})
    assert load_numbering(tmp_path / "missing") == Numbering()


def test_the_wal_is_read_without_being_written(tmp_path):
    _wal(tmp_path / "w", ["d-0000000", "d-0000001", "d-0000002", "d-0000005"],
         {"b0": ["d-0000000", "d-0000001"], "b1": ["d-0000002"]}, ["b0"])
    before = {p.name: p.read_bytes() for p in (tmp_path / "w").iterdir()}
    view = scan_wal(tmp_path / "w", group_size=2)
    assert view.max_group == 5  # consumed ids count too
    assert view.live == 4 and view.outstanding == {"b1": 2}
    assert {p.name: p.read_bytes() for p in (tmp_path / "w").iterdir()} == before


def _run_folder(tmp_path: Path, journal_next: int, version: int, trained: int, trained_batches: list[str]) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "latest").mkdir(parents=True)
    (run / "checkpoints" / "latest" / "progress.json").write_text(json.dumps(
        {"step": version, "version": version, "samples_trained": trained, "trained": trained_batches}))
    _wal(run / "buffer-wal", ["d-0000000", "d-0000001", "d-0000002", "d-0000003"],
         {"b0": ["d-0000000"], "b1": ["d-0000001"]}, ["b0"])
    j = NumberingJournal(run / NUMBERING)
    j.record(Numbering(next_group=journal_next, tasks={"d": journal_next + 3}))
    j.close()
    rows = [{"time": 1.0, "elapsed": 10.0, "source": "controller", "step": 0, "version": 0,
             "scalars": {"eval/version": 0.0, "eval/accuracy": 0.25, "eval/d/accuracy": 0.25}},
            {"time": 2.0, "elapsed": 50.0, "source": "controller", "step": 4, "version": 4,
             "scalars": {"eval/version": 4.0, "eval/accuracy": 0.5, "eval/d/accuracy": 0.5}},
            {"time": 3.0, "elapsed": 70.0, "source": "controller", "step": 8, "version": 8,
             "scalars": {"eval/version": 8.0, "eval/accuracy": 0.75, "eval/d/accuracy": 0.75}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    return run


def test_the_resume_point_rebuilds_numbering_and_gate_from_wal_and_checkpoint(tmp_path):
    # the checkpoint (version 6) trained b0 (consumed) and b1 (served, not acknowledged: the buffer
    # still holds it, and will consume it when the learner reconnects): 2 samples counted once
    run = _run_folder(tmp_path, journal_next=2, version=6, trained=24, trained_batches=["b0", "b1"])
    p = resume_point(run, 2, run / "buffer-wal", run / "checkpoints")
    assert p.next_group == 4  # past the WAL's highest group (3), though the journal said 2
    assert p.draws == 2 and p.tasks == {"d": 5}
    assert p.live == 6 and p.accepted == 24 + 6 - 2
    assert p.gate_state() == {"version": 6, "accepted": 28, "in_flight": 0, "granted": 0, "rejected": 0}
    assert [e[0] for e in p.evals] == [0, 4]  # version 8 scored weights the checkpoint does not hold
    assert p.evals[1] == (4, 0.5, {"d": 0.5})
    assert p.elapsed_s == 70.0
    # the journal ahead of the WAL (groups handed out, never delivered): its number wins
    run2 = _run_folder(tmp_path / "2", journal_next=40, version=6, trained=24, trained_batches=["b0"])
    assert resume_point(run2, 2, run2 / "buffer-wal", run2 / "checkpoints").next_group == 40


def test_eval_history_keeps_the_last_row_of_each_version():
    rows = [{"source": "controller", "scalars": {"eval/version": 2.0, "eval/accuracy": 0.1}},
            {"source": "controller", "scalars": {"eval/version": 2.0, "eval/accuracy": 0.2}},
            {"source": "learner-0", "scalars": {"train/version": 3.0}}]
    assert eval_history(rows, 10) == [(2, 0.2, {})]


def test_a_completed_run_has_nothing_to_resume_unless_the_budget_grows(tmp_path):
    assert "no config.json" in check_resumable(tmp_path, 10)
    (tmp_path / "config.json").write_text("{}")
    assert check_resumable(tmp_path, 10) == ""  # no final.json: its driver was killed
    (tmp_path / "final.json").write_text(json.dumps({"status": "interrupted", "versions": 3}))
    assert check_resumable(tmp_path, 10) == ""
    (tmp_path / "final.json").write_text(json.dumps({"status": "completed", "versions": 10, "budget_versions": 10}))
    assert "nothing to resume" in check_resumable(tmp_path, 10)
    assert check_resumable(tmp_path, 20) == ""


def test_a_second_driver_on_the_same_folder_is_refused(tmp_path):
    lock = hold_lock(tmp_path)
    try:
        with pytest.raises(RunFolderBusy, match="in use by another tidal driver"):
            hold_lock(tmp_path)
    finally:
        lock.close()
    hold_lock(tmp_path).close()  # free again


def test_tidal_run_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "none")]) == 2
    assert "holds no run to resume" in capsys.readouterr().err
    cfg = load_recipe(RECIPE, [f'model="{tmp_path}"'])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(msgspec.json.encode(cfg))
    (run / "final.json").write_text(json.dumps({"status": "completed", "versions": 30, "budget_versions": 30}))
    assert main(["run", "--resume", str(run)]) == 0
    assert "nothing to resume" in capsys.readouterr().err


def test_a_resumed_controller_continues_numbering_gate_and_history(tmp_path):
    cfg = load_recipe(RECIPE, ["eval.every=0", f'model="{tmp_path}"', "max_staleness=1"])
    # what the interrupted run left: a gate file whose in-flight count died with its workers
    (tmp_path / "depth_gate.json").write_text(json.dumps(
        {"version": 6, "accepted": 512, "in_flight": 192, "granted": 704, "rejected": 0}) + "\n")
    point = ResumePoint(version=6, samples_trained=384, next_group=57, draws=50, tasks={"arithmetic": 55},
                        accepted=400, live=16, evals=[(0, 0.3, {}), (4, 0.4, {})], elapsed_s=120.0)
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                     buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                     emit=lambda m: None, resume=point)
    w = dealer(ctl.ch.endpoint, identity=b"rollout-0", linger=0)
    try:
        s = ctl.gate.state
        assert (s.version, s.accepted, s.in_flight) == (6, 400, 0)
        assert ctl.learner_version == 6 and ctl.eval_results == [(0, 0.3, {}), (4, 0.4, {})]
        # a worker still on the starting weights gets no training work
        w.send(WorkRequest(want=2, version=0))
        deadline = time.monotonic() + 10
        while "rollout-0" not in ctl.workers:
            assert time.monotonic() < deadline
            ctl.step(0.02)
        for _ in range(20):
            ctl.step(0.02)
        assert ctl.counts["groups_granted"] == 0
        # once it holds the checkpoint's version, numbering carries on from the resume point
        w.send(WorkRequest(want=0, version=6))
        got: list[Assignment] = []
        deadline = time.monotonic() + 10
        while len(got) < 2:
            assert time.monotonic() < deadline, "no assignment came"
            ctl.step(0.02)
            try:
                msg = w.recv(timeout=0.05)
            except Exception:
                continue
            if isinstance(msg, Assignment):
                got.append(msg)
        assert [a.group_id for a in got] == ["arithmetic-0000057", "arithmetic-0000058"]
        assert load_numbering(tmp_path / NUMBERING) == Numbering(next_group=59, tasks={"arithmetic": 57})
    finally:
        w.close()
        ctl.close()


def test_a_stall_message_names_the_gate_the_duplicates_and_what_each_worker_waits_for(tmp_path):
    cfg = load_recipe(RECIPE, ["eval.every=0", f'model="{tmp_path}"'])
    ctl = Controller(cfg, endpoint="tcp://127.0.0.1:*", learner_pub="tcp://127.0.0.1:9",
                     buffer_pub="tcp://127.0.0.1:9", run_dir=tmp_path, tokenizer=build_char_tokenizer(),
                     emit=lambda m: None)
    try:  # what issue 38 showed: the gate full of a dead run's groups, the buffer dropping duplicates
        ctl.gate.load_state_dict({"version": 4, "accepted": 256, "in_flight": 192})  # (2 + 4 + 1) x 64
        ctl.last["buffer"] = {"total/duplicates": 192.0, "depth/ready_samples": 0.0}
        from tidal.integration.workers import WorkerState

        ctl.workers["rollout-0"] = WorkerState(name="rollout-0", peer=b"rollout-0", version=0)
        text = ctl.diagnose()
        assert "depth gate: capacity 0" in text and "in flight 192" in text
        assert "total/duplicates 192" in text and "duplicates dropped" in text
        assert "rollout-0 waits for weights (holds version 0, gate at 4)" in text
    finally:
        ctl.close()


def test_a_fresh_run_into_a_folder_that_holds_one_points_to_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert main(["run", str(RECIPE), f'model="{tmp_path}"', f'run_dir="{run}"']) == 2
    assert f"continue it with tidal run --resume {run}" in capsys.readouterr().err
