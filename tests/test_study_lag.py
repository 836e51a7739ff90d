"""The lag study (tools/study/lag.py) still runs end to end at a tiny size: real runs at two publish periods
for two objectives, its JSON summary and PNG written, and publishing every L steps showing in the lag the
runs measured. The numbers themselves are the study's to report (README), not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lag_study_runs_and_reports(tmp_path):
    out = tmp_path / "lag"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "study" / "lag.py"), "--out", str(out), "--lags", "1,4",
         "--objectives", "default,oapl", "--versions", "8", "--eval-every", "4", "--seeds", "1",
         "--set", "sft.steps=20", "--minutes", "4"],
        capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "lag.json").read_text())
    assert (out / "lag.png").stat().st_size > 0
    rows = {(r["objective"], r["lag"]): r for r in report["summary"]}
    assert set(rows) == {("default", 1), ("default", 4), ("oapl", 1), ("oapl", 4)}
    for r in rows.values():
        assert r["seeds"] == 1 and r["final_acc"] is not None and r["curve"][-1]["version"] == 8, r
    # every 4 steps: samples up to 3 versions old, by design (a depth gate of max_staleness 3)
    assert rows[("default", 4)]["lag_max"] == 3 and rows[("oapl", 4)]["lag_max"] == 3
    assert "gap_points_at_L16" in report["goal"]
