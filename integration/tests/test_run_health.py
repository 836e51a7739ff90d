"""Run health in view, from a run folder: `tidal status` (state from final.json and the liveness of the
processes in pids.json, restarts, gate, buffer depth, last errors, the resume command), report.png's
health row and event marks, and the driver's console (the progress line, warnings, errors; the
per-evaluation INFO lines in logs/driver.log only). The processes here are real (`sleep`), the metrics
are written by the real MetricsSink."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tidal.core.protocol import Metrics
from tidal.integration.cli import main
from tidal.integration.health import run_health
from tidal.integration.monitor import MetricsSink
from tidal.integration.report import events, report
from tidal.integration.run import driver_log
from tidal.integration.supervisor import write_final, write_health


def write_rows(run_dir: Path, restart_at: int = 3) -> None:
    """A short run's metrics as its roles and driver write them: learner, buffer, rollout, controller
    rows, a restart of rollout-1 and a resume."""
    sink = MetricsSink(run_dir, tensorboard=False)
    t = time.time()
    for v in range(1, 7):
        sink(Metrics(source="learner-0", step=v, time=t + v, scalars={"train/version": float(v), "reward/mean": 0.1 * v,
                                                                      "train/samples_total": 64.0 * v,
                                                                      "train/sequences": 64.0}))
        sink(Metrics(source="buffer", step=v, time=t + v, scalars={"depth/ready_samples": 8.0 * v,
                                                                   "depth/live_trajectories": 16.0 * v}))
        sink(Metrics(source="rollout-0", step=v, time=t + v, scalars={"rollout/samples_per_s": 30.0}))
        sink(Metrics(source="controller", step=v, time=t + v, scalars={"controller/gate_in_flight": 3.0,
                                                                       "controller/gate_capacity": 4.0,
                                                                       "controller/learner_version": float(v)}))
        if v == restart_at:
            sink(Metrics(source="controller", step=v, time=t + v,
                         scalars={"event/restart": 1.0, "event/restart/rollout-1": 1.0}))
        if v == 5:
            sink(Metrics(source="controller", step=v, time=t + v, scalars={"event/resume": 1.0}))
    sink.close()


def status_of(run_dir: Path, capsys) -> str:
    assert main(["status", str(run_dir)]) == 0
    return capsys.readouterr().out


def test_status_of_a_running_then_killed_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"budget": {"versions": 60}}))
    write_rows(run_dir)
    write_health(run_dir, {"time": time.time(), "restarts": {"rollout-1": 1},
                           "errors": {"rollout-1": "engine died: CUDA error"}})
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / "pids.json").write_text(json.dumps({"buffer": role.pid}))
        out = status_of(run_dir, capsys)
        assert f"{run_dir}: running at version 6/60" in out
        assert "gate        3 samples in flight, room for 4 more" in out
        assert "buffer      depth 48 ready samples, 96 trajectories held" in out
        assert "restarts    rollout-1 1" in out
        assert "last error  rollout-1: engine died: CUDA error" in out
        assert f"buffer {role.pid} (alive)" in out
        assert "--resume" not in out  # a running run is not continued
    finally:
        role.kill()
        role.wait(timeout=30)
    out = status_of(run_dir, capsys)  # every role gone and no final.json: the driver was killed
    assert f"{run_dir}: interrupted at version 6/60" in out
    assert f"buffer {role.pid} (gone)" in out
    assert f"continue:   tidal run --resume {run_dir}" in out


def test_status_from_final_json(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_rows(run_dir)
    write_final(run_dir, {"status": "stalled: no new policy version for 300 s", "versions": 6,
                          "budget_versions": 60, "restarts": {"learner": 2},
                          "errors": {"learner": "CUDA out of memory"}})
    h = run_health(run_dir)
    assert (h["state"], h["restarts"], h["errors"]) == ("stalled", {"learner": 2}, {"learner": "CUDA out of memory"})
    out = status_of(run_dir, capsys)
    assert "final.json  stalled: no new policy version for 300 s" in out
    assert f"tidal run --resume {run_dir}" in out
    write_final(run_dir, {"status": "completed", "versions": 60, "budget_versions": 60})
    out = status_of(run_dir, capsys)
    assert f"{run_dir}: completed at version 60/60" in out and "--resume" not in out


def test_status_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "is it a tidal run folder" in capsys.readouterr().err


def test_report_marks_restarts_and_resumes_and_shows_throughput_and_depth(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_rows(run_dir)
    png = report(run_dir)
    assert png.stat().st_size > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["events"] == {"restart": 1, "resume": 1}
    from tidal.integration.monitor import read_metrics
    from tidal.integration.report import throughput

    evs = events(read_metrics(run_dir))
    assert [(kind, detail) for _, kind, detail in evs] == [("restart", "rollout-1"), ("resume", "")]
    tp = throughput(read_metrics(run_dir))
    assert len(tp["trained"][1]) == 5 and np.allclose(tp["trained"][1], 64.0, rtol=0.2)
    assert tp["generated"][1] and all(g == 30.0 for g in tp["generated"][1])


def test_evaluation_lines_go_to_the_driver_log_only(tmp_path):
    console = io.StringIO()
    handler = logging.StreamHandler(console)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with driver_log(tmp_path) as path:
            logging.getLogger("tidal.controller").info("eval at version 10: accuracy 0.500")
            logging.getLogger("tidal.controller").warning("worker rollout-1 lost: 2 groups handed out again")
            logging.getLogger("tidal.run").info("learner finished 60 versions")
        logging.getLogger("tidal.controller").info("after the run: the console again")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    shown = console.getvalue()
    assert "eval at version 10" not in shown
    assert "worker rollout-1 lost" in shown and "learner finished 60 versions" in shown
    assert "after the run" in shown  # the filter is gone with the run
    logged = path.read_text()
    assert "eval at version 10: accuracy 0.500" in logged and "worker rollout-1 lost" in logged
