"""Every benchmark in tools/bench/ still runs (tiny sizes) and prints its JSON line: a benchmark that
rots silently measures nothing. Timings are not checked (machines are noisy); the slow tier runs this."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "transport.py": ["--small", "2000", "--large", "2", "--trials", "1"],
    "algos.py": ["--batch", "4", "--tokens", "64", "--reps", "1"],
    "buffer.py": ["--n", "1024", "--mib", "4", "--trials", "1", "--relay"],
    "weight_sync.py": ["--big-gib", "0.02", "--small", "60", "--trials", "1", "--bucket-mib", "4"],
    "engine.py": ["--requests", "16", "--concurrency", "4", "--max-tokens", "16", "--reps", "1", "--shape", "both",
                  "--rounds", "2", "--groups", "2"],
    "learner.py": ["--samples", "8", "--max-len", "64", "--hidden", "64", "--layers", "1", "--reps", "1", "--sp-len", "256"],
    "moe.py": ["--tokens", "256", "--hidden", "64", "--ffn", "128", "--experts", "4"],
    "seqpar.py": ["--lengths", "256", "--ranks", "1,2", "--modes", "ulysses", "--hidden", "64", "--mlp", "128",
                  "--block", "64", "--timeout", "200"],
    "pipeline.py": ["--versions", "4", "--batch-groups", "2", "--workers", "1", "--train-ms", "1"],
    "control_plane.py": ["--workers", "2,3", "--versions", "20", "--step-ms", "400"],
    "tool_ceiling.py": ["--steps", "5", "--eval-size", "8"],
    # its own tiny warm start (20 SFT steps) in the test's folder; one run of each system, 3 versions
    "lora.py": ["--repeats", "1", "--sft-steps", "20", "--model", "{tmp}/none", "--out", "{tmp}/lora",
                "--set", "budget.versions=3", "--set", "eval.every=3", "--set", "eval.size=16"],
    # both workloads, TRL and Tidal async + sync; warm starts go to the test's own folder ({tmp}), not runs/
    "vs_trl.py": ["--workload", "both", "--steps", "4", "--eval-size", "16", "--eval-every", "2", "--sft-steps", "20",
                  "--minutes", "3", "--out", "{tmp}/vs_trl"],
}


def test_every_benchmark_is_listed():
    assert {p.name for p in (ROOT / "tools" / "bench").glob("*.py")} == set(TINY)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(TINY))
def test_benchmark_runs_and_reports(script, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in TINY[script]]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, f"{script} printed no JSON report:\n{proc.stdout[-2000:]}"
    if script == "transport.py":  # CURVE measured beside plaintext and its one-core cipher limit
        curve = reports[-1]["curve"]
        assert curve["small_msgs_per_s"] > 0 and curve["large_gb_per_s"] > 0, curve
        assert curve["limit_large_gb_per_s"] > 0 and curve["limit_small_msgs_per_s"] > 0, curve
        assert curve["large_goal"] in ("PASS", "MISS") and curve["large_vs_plain"] > 0, curve
    if script == "control_plane.py":  # every count measured, with its latencies, and where one core runs out
        rows = reports[-1]["rows"]
        assert [r["workers"] for r in rows] == [2, 3], rows
        for r in rows:
            assert r["ctl_msgs_per_s"] > 0 and r["buf_traj_per_s"] > 0 and r["groups_per_s"] > 0, r
            assert r["version_to_all_ms_median"] >= 0 and r["credit_rtt_ms_median"] > 0, r  # NaN fails both
        assert all(s["workers_at_one_core"] > 0 for s in reports[-1]["saturation"].values()), reports[-1]["saturation"]
    if script == "engine.py":  # both shapes measured
        assert [r.get("shape", "longtail") for r in reports] == ["demo", "longtail"], reports
    if script == "vs_trl.py":  # every system of every workload measured, not just a JSON line
        for name, w in reports[-1]["workloads"].items():
            assert set(w["systems"]) == {"trl", "async", "sync"}, (name, sorted(w["systems"]))
            # each Tidal mode again with evaluation out of the clock: the throughput that meets TRL's
            for mode in ("async", "sync"):
                assert w["systems"][mode]["no_eval"]["samples_per_s"] > 0, (name, mode, w["systems"][mode])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["zmq", "torch_dist"])
def test_weight_sync_raw_baseline_and_transport_move_the_same_bytes(transport, monkeypatch):
    """The weight-sync bench's ratio compares like with like: its raw stream and the bucketed transport
    carry bit-identical bytes for the 3,000-tensor state (tiny tensors here), equal to what was sent; for
    gloo, the verified floor's pieces reach the receiver with the checksums the sender computed (the bench
    raises otherwise)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools" / "bench"))  # the spawned receiver imports it by name
    import weight_sync as bench

    state = bench.small_state(3000, lo=16, hi=1024)
    result = bench.time_transport(transport, state, 1, 64 * 1024, raw=True)
    assert result["identical"] is True
    assert result["raw_s"] > 0 and result["vs_raw"] > 0
    if transport == "torch_dist":
        assert result["floor_s"] > 0 and result["floor_vs_raw"] > 0
    else:
        assert "floor_s" not in result
