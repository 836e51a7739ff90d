"""A run's health from its folder alone, for `tidal status`: works while the run goes on (from another
terminal), after it ended, and after its driver died without a word.

- state: from final.json (`completed`, `interrupted`, `stalled`, `failed`) once the run wrote it;
  before that, `running` while a role in pids.json is alive (Ray roles on another node: while
  metrics.jsonl is fresh), else `interrupted` (the driver is gone: killed, or the machine went down);
- restarts and each role's last error: final.json, or while running health.json (the driver rewrites it
  every few seconds);
- gate capacity and in-flight groups (the controller's rows), buffer depth (the buffer's rows), the
  learner's version: the newest rows of metrics.jsonl;
- the command that continues the run, where one applies (interrupted, stalled, failed).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from tidal.integration.launch import read_pids
from tidal.integration.monitor import read_metrics

FRESH_S = 30.0  # metrics this recent mean a run whose roles this machine cannot see is still going
RESUMABLE = ("interrupted", "stalled", "failed")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _local_addresses() -> set[str]:
    out = {"", "127.0.0.1", "localhost", socket.gethostname()}
    try:
        out.update(str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    try:  # the address a route out of this machine uses (Ray's node address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: connect on UDP only picks a route
            out.add(s.getsockname()[0])
    except OSError:
        pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def run_health(run_dir: str | Path) -> dict[str, Any]:
    """What `tidal status` shows, as a dict: state, status (final.json's line), version, restarts,
    errors, gate, buffer, processes {role: {node, pid, alive (None: on another node)}}, last_metrics_s,
    resume (the command, or "")."""
    run_dir = Path(run_dir)
    final = _json(run_dir / "final.json")
    health = _json(run_dir / "health.json") or {}
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        rows = []
    latest: dict[str, dict] = {}
    for r in rows:
        latest[r["source"]] = {**latest.get(r["source"], {}), **r["scalars"]}
    last_row = max((r["time"] for r in rows), default=None)
    last_metrics_s = time.time() - last_row if last_row is not None else None

    local = _local_addresses()
    processes: dict[str, dict[str, Any]] = {}
    for name, (node, pid) in read_pids(run_dir).items():
        processes[name] = {"node": node or "local", "pid": pid, "alive": pid_alive(pid) if node in local else None}
    alive = any(p["alive"] for p in processes.values())
    remote_fresh = (any(p["alive"] is None for p in processes.values())
                    and last_metrics_s is not None and last_metrics_s < FRESH_S)
    pids_at = (run_dir / "pids.json").stat().st_mtime if (run_dir / "pids.json").exists() else 0.0
    final_at = (run_dir / "final.json").stat().st_mtime if final is not None else 0.0
    running = (alive or remote_fresh) and (final is None or pids_at > final_at)  # a resumed run runs again
    if running:
        state, status = "running", "running"
    elif final is not None:
        status = str(final.get("status", "unknown"))
        state = status.split(":", 1)[0].strip()
    else:
        state = "interrupted"
        status = ("interrupted: no final.json and no role alive (the driver was killed, or its machine went "
                  "down)" if processes or rows else "not started: no role was started in this folder")
        if not processes and not rows:
            state = "not started"
    src = final if final is not None and not running else health
    controller = latest.get("controller", {})
    buffer = next((v for k, v in latest.items() if k.startswith("buffer")), {})
    learner = latest.get("learner-0", {})
    version = int(max(controller.get("controller/learner_version", 0.0), learner.get("train/version", 0.0),
                      float(final.get("versions", 0)) if final is not None and not running else 0.0))
    budget = final.get("budget_versions") if final is not None else None
    if budget is None:
        budget = (_json(run_dir / "config.json") or {}).get("budget", {}).get("versions")
    return {
        "run_dir": str(run_dir), "state": state, "status": status, "version": version, "budget_versions": budget,
        "restarts": dict((src or {}).get("restarts", {})), "errors": dict((src or {}).get("errors", {})),
        "gate": {k: controller[f"controller/gate_{k}"] for k in ("capacity", "in_flight")
                 if f"controller/gate_{k}" in controller},
        "buffer": {k: buffer[f"depth/{k}"] for k in ("ready_samples", "live_trajectories") if f"depth/{k}" in buffer},
        "processes": processes, "last_metrics_s": last_metrics_s,
        "signal": {k.removeprefix("signal/"): v for k, v in learner.items() if k.startswith("signal/")
                   and k.count("/") == 1},
        "resume": f"tidal run --resume {run_dir}" if state in RESUMABLE else "",
    }


def format_health(h: dict[str, Any]) -> list[str]:
    """The lines `tidal status` prints (before each role's latest numbers)."""
    ago = f", last metrics {h['last_metrics_s']:.0f} s ago" if h["last_metrics_s"] is not None else ""
    budget = f"/{h['budget_versions']}" if h["budget_versions"] else ""
    lines = [f"{h['run_dir']}: {h['state']} at version {h['version']}{budget}{ago}"]
    if h["status"] not in (h["state"], "running"):
        lines.append(f"  final.json  {h['status']}")
    gate = h["gate"]
    if gate:
        # the depth gate counts samples: granted to workers and not yet in the buffer, and how many more
        # it may grant before max_staleness binds (capacity is what is left, not a total)
        lines.append(f"  gate        {gate.get('in_flight', 0):.0f} samples in flight, room for "
                     f"{gate.get('capacity', 0):.0f} more")
    if h["buffer"]:
        b = h["buffer"]
        lines.append(f"  buffer      depth {b.get('ready_samples', 0):.0f} ready samples"
                     + (f", {b['live_trajectories']:.0f} trajectories held" if "live_trajectories" in b else ""))
    sig = h.get("signal") or {}
    if "nonzero_adv_frac" in sig:
        # what the last step could learn from: groups whose rewards are all equal give GRPO no direction
        lines.append(f"  signal      {100 * sig['nonzero_adv_frac']:.0f} % of the last step's samples had a nonzero "
                     f"advantage; groups with equal rewards {100 * sig.get('zero_variance_frac', 0.0):.0f} % "
                     f"(all zero {100 * sig.get('all_zero_frac', 0.0):.0f} %, all at the best "
                     f"{100 * sig.get('all_max_frac', 0.0):.0f} %)")
    restarts = ", ".join(f"{k} {v}" for k, v in sorted(h["restarts"].items()) if v)
    lines.append(f"  restarts    {restarts or 'none'}")
    if h["processes"]:
        lines.append("  processes   " + ", ".join(
            f"{n} {p['pid']}" + (f"@{p['node']}" if p["node"] != "local" else "")
            + {True: " (alive)", False: " (gone)", None: " (another node)"}[p["alive"]]
            for n, p in sorted(h["processes"].items())))
    for role, error in sorted(h["errors"].items()):
        lines.append(f"  last error  {role}: {error}")
    if h["resume"]:
        lines.append(f"  continue:   {h['resume']}")
    return lines
