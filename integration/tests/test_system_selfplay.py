"""Self-play as `tidal run` runs it (every role a real process): integration/recipes/selfplay.toml on a tiny
model warm-started on nim's format, with a pool of snapshots. The run is interrupted (Ctrl-C) once the pool
holds snapshots and has rated them, and resumed with `tidal run --resume`: the resumed controller takes
the pool and its ratings back from <run_dir>/selfplay.json and goes on rating them; the report has the
self-play row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

RECIPE = Path(__file__).parents[1] / "recipes" / "selfplay.toml"


@pytest.fixture(scope="module")
def nim_model(tmp_path_factory):
    """A tiny model that knows nim's format (random legal moves), none of its strategy."""
    from tidal.integration.sft import SFTConfig, sft
    from tidal.rollout.envs.nim import Nim, demonstration
    from tidal.rollout.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("selfplay")
    base = build_tiny_model(root / "base", seed=0)
    sft(base, root / "sft", Nim(), SFTConfig(steps=150, batch=64, lr=1e-3), demonstrate=demonstration)
    return root / "sft"


def _run(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tidal.integration.cli", "run", *args], stdout=open(log, "a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "selfplay.json").read_text())


def test_an_interrupted_selfplay_run_resumes_with_its_pool_and_ratings(tmp_path, nim_model):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = _run(str(RECIPE), f'model="{nim_model}"', f'run_dir="{run_dir}"', "workers=1", "budget.versions=40",
                "budget.minutes=0", "eval.every=40", "eval.size=16", "learner.checkpoint_every=4",
                "selfplay.opponent.options.every=3", 'monitor.progress="log"', log=log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            try:
                state = _state(run_dir)
            except (OSError, ValueError):
                continue
            if len(state.get("pool", [])) >= 3 and any(r[0] == "pool" for r in state.get("results", [])):
                break
        assert proc.poll() is None, log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the driver stops its roles, the run can be resumed
        proc.wait(timeout=120)
        before = _state(run_dir)
        proc = _run("--resume", str(run_dir), log=log)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    driver = (run_dir / "logs" / "driver.log").read_text()
    assert "self-play: opponent pool state restored" in driver, driver[-3000:]
    after = _state(run_dir)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed"
    # the pool went on from where it was: the snapshots it held were rated before the interruption, and
    # every one of them still in the pool was rated on from that rating (never from a fresh start)
    kept = {p["version"]: p for p in before["pool"]}
    later = {p["version"]: p for p in after["pool"]}
    assert max(later) > max(kept) and after["live"]["sigma"] <= before["live"]["sigma"] + 0.05
    for v in set(kept) & set(later):
        assert later[v]["sigma"] <= kept[v]["sigma"] + 0.05, (v, kept[v], later[v])
    # snapshots are kept every 3 versions, and the ones that left the pool were deleted
    files = sorted(int(p.name[1:7]) for p in (run_dir / "snapshots").glob("v*.safetensors"))
    assert set(later) <= set(files) and all(v % 3 == 0 for v in files)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["selfplay"]["pool_size"] == len(after["pool"])
