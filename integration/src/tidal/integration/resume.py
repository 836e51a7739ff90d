"""Resuming a run from its folder: `tidal run --resume RUN_DIR`.

What a run continues from, and where it lives in the run folder (never in a dead process's memory):

- `config.json`: the effective recipe; overrides given to `--resume` are applied on top and recorded.
- `numbering.jsonl` (`Numbering`): the next training group number and the tasks drawn per domain, a
  journal line written *before* each assignment leaves the controller, so a driver killed with SIGKILL
  never hands out a group number twice. The buffer's write-ahead log is read too (`scan_wal`): the next
  group number is past every group the buffer holds or consumed, whichever is higher.
- `checkpoints/latest/progress.json`: the learner's version and the samples it trained.
- `buffer-wal/`: read (never written) to count the samples the buffer holds; the depth gate is rebuilt
  from these two (`ResumePoint.gate_state`): accepted = trained by the checkpoint + held by the buffer
  (less the served batches the checkpoint already trained), in flight = 0 (the groups the dead run had
  handed out died with its workers).
- `metrics.jsonl` (appended, never rewritten): the evaluation history and the elapsed time; a resume
  writes a `resume` row (source "driver", `resume/version`, `resume/elapsed_s`).
- `driver.lock`: an exclusive lock (flock) held by the driver for its life: a second driver on the
  same folder is refused; the kernel drops it when the driver dies, however it dies.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from tidal.buffer import wal
from tidal.buffer.store import Store
from tidal.integration.signal_watch import NOTHING_LEARNED

NUMBERING = "numbering.jsonl"
LOCK = "driver.lock"
COMPACT_EVERY = 4096
_GROUP_NUMBER = re.compile(r"-(\d+)$")


class RunFolderBusy(Exception):
    """Another driver holds the run folder."""


class NothingToResume(Exception):
    """The run folder holds no run that can be resumed (message says why and what to do)."""


def resume_command(run_dir: Path | str) -> str:
    return f"tidal run --resume {run_dir}"


# ---------------------------------------------------------------------- the driver's lock


def hold_lock(run_dir: Path) -> IO[str]:
    """The run folder's lock, held until the returned file is closed (or the process dies)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise RunFolderBusy(f"{run_dir} is in use by another tidal driver (pid {pid}); stop it first "
                            f"(Ctrl-C or kill {pid}) or use another run folder") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _alive_role(pid: int, run_dir: Path) -> bool:
    """A role of this run folder still running (its command line names the folder; not a zombie)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and (str(run_dir.resolve()) in cmd or str(run_dir) in cmd)


def wait_roles_gone(run_dir: Path, timeout: float) -> None:
    """The roles a dead driver left (pids.json) exit on their own (they are bound to it: SIGTERM on its
    death, then the learner writes its exit checkpoint): wait for that, up to `timeout`."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout
    left = {n: p for n, p in pids.items() if _alive_role(int(p), run_dir)}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {n: p for n, p in left.items() if _alive_role(int(p), run_dir)}
    if left:
        raise RunFolderBusy(f"roles of the previous run of {run_dir} are still running after {timeout:.0f} s: "
                            + ", ".join(f"{n} (pid {p})" for n, p in left.items())
                            + "; stop them (kill PID) and resume again")


# ---------------------------------------------------------------------- group numbering


class Numbering(msgspec.Struct):
    next_group: int = 0
    tasks: dict[str, int] = {}  # domain -> train tasks drawn from its iterator


class NumberingJournal:
    """`Numbering` persisted as a journal (one JSON line per change, in one write; compacted to its last
    line every COMPACT_EVERY lines). The last line that decodes wins."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = load_numbering(path)
        self._fd: int | None = None
        self._lines = 0

    def record(self, state: Numbering) -> None:
        self.state = state
        line = msgspec.json.encode(state) + b"\n"
        if self._fd is None or self._lines >= COMPACT_EVERY:
            if self._fd is not None:
                os.close(self._fd)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(line)
            os.replace(tmp, self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self._lines = 1
            return
        os.write(self._fd, line)
        self._lines += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def load_numbering(path: Path) -> Numbering:
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return Numbering()
    for line in reversed(lines):  # a last line cut short by a crash: the one before it
        try:
            return msgspec.json.decode(line, type=Numbering)
        except msgspec.MsgspecError:
            continue
    return Numbering()


def group_number(trajectory_id: str) -> int | None:
    """n of a training sample id `<domain>-<n>:<index>` (tidal.core.protocol.group_id), else None."""
    m = _GROUP_NUMBER.search(trajectory_id.split(":", 1)[0])
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------- the buffer's WAL, read only


@dataclass
class WalView:
    max_group: int = -1  # the highest group number among the samples the buffer holds or consumed
    live: int = 0  # samples it holds (ready, assembling, served and not consumed)
    outstanding: dict[str, int] = field(default_factory=dict)  # served batch id -> its samples


def scan_wal(wal_dir: Path, group_size: int) -> WalView:
    """What the buffer will hold when it replays `wal_dir`, read without touching the files (the buffer
    itself truncates a torn tail when it starts)."""
    view = WalView()
    if not wal_dir.is_dir():
        return view
    segs = sorted(wal_dir.glob("wal-*.log"), key=lambda p: int(p.stem.split("-")[1]))
    report = wal.ReplayReport()
    parsed = [wal.read_segment(s, report)[0] for s in segs]
    start = max((i for i, recs in enumerate(parsed) if recs and isinstance(recs[0], wal.Snapshot)), default=0)
    store = Store(group_size, dedupe_window=1 << 62)  # every consumed id kept: the highest group number counts
    for recs in parsed[start:]:
        for rec in recs:
            store.apply(rec)
    numbers = [n for ids in (store.where, store.consumed_ids.old, store.consumed_ids.new) for i in ids
               if (n := group_number(i)) is not None]
    view.max_group = max(numbers, default=-1)
    view.live = store.live_trajectories
    view.outstanding = {b: len(s.trajectories) for b, s in store.outstanding.items()}
    return view


# ---------------------------------------------------------------------- metrics history


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        text = (run_dir / "metrics.jsonl").read_bytes()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return rows


def eval_history(rows: list[dict[str, Any]], up_to: int) -> list[tuple[int, float, dict[str, float]]]:
    """The evaluations metrics.jsonl recorded for versions <= `up_to` (later ones scored weights the
    checkpoint does not hold), the last one of each version, in version order."""
    out: dict[int, tuple[int, float, dict[str, float]]] = {}
    for r in rows:
        s = r.get("scalars", {})
        if r.get("source") != "controller" or "eval/version" not in s or "eval/accuracy" not in s:
            continue
        v = int(s["eval/version"])
        if v <= up_to:
            per = {k[len("eval/"):-len("/accuracy")]: float(x) for k, x in s.items()
                   if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2}
            out[v] = (v, float(s["eval/accuracy"]), per)
    return [out[v] for v in sorted(out)]


# ---------------------------------------------------------------------- the resume point


@dataclass
class ResumePoint:
    version: int = 0  # the checkpoint's version (the learner continues from it)
    samples_trained: int = 0
    next_group: int = 0
    draws: int = 0  # groups the numbering journal recorded (the domain draws made so far)
    tasks: dict[str, int] = field(default_factory=dict)
    accepted: int = 0  # samples the depth gate counts as having reached the buffer
    live: int = 0
    evals: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)
    elapsed_s: float = 0.0
    resumes: int = 0  # earlier resumes of this folder

    def gate_state(self, granted: int = 0, rejected: int = 0) -> dict[str, int]:
        """The depth gate's counters (tidal.staleness GateState) for the resumed run."""
        return {"version": self.version, "accepted": self.accepted, "in_flight": 0,
                "granted": granted, "rejected": rejected}

    def describe(self) -> str:
        return (f"version {self.version} ({self.samples_trained} samples trained), next group {self.next_group}, "
                f"{self.live} samples in the buffer, {len(self.evals)} earlier evaluations, "
                f"{self.elapsed_s / 60:.1f} min elapsed")


def resume_point(run_dir: Path, group_size: int, wal_dir: Path, checkpoint_dir: Path) -> ResumePoint:
    p = ResumePoint()
    progress: dict[str, Any] = {}
    try:
        progress = json.loads((checkpoint_dir / "latest" / "progress.json").read_text())
    except (OSError, ValueError):
        pass
    p.version = int(progress.get("version", 0))
    p.samples_trained = int(progress.get("samples_trained", 0))
    trained_batches = set(progress.get("trained", []))
    numbering = load_numbering(run_dir / NUMBERING)
    w = scan_wal(wal_dir, group_size)
    p.next_group = max(numbering.next_group, w.max_group + 1)
    p.draws, p.tasks = numbering.next_group, dict(numbering.tasks)
    p.live = w.live
    # served batches the checkpoint trained are consumed when the learner reconnects: counted once
    p.accepted = p.samples_trained + w.live - sum(n for b, n in w.outstanding.items() if b in trained_batches)
    rows = read_rows(run_dir)
    p.evals = eval_history(rows, p.version)
    p.elapsed_s = max((float(r.get("elapsed", 0.0)) for r in rows), default=0.0)
    p.resumes = sum(1 for r in rows if r.get("source") == "driver" and "resume/version" in r.get("scalars", {}))
    return p


def check_resumable(run_dir: Path, budget_versions: int) -> str:
    """Why `run_dir` cannot be resumed with a budget of `budget_versions` (a message naming what to do),
    or "" when it can."""
    if not (run_dir / "config.json").is_file():
        return (f"{run_dir} holds no run to resume (no config.json); start one with "
                f"tidal run RECIPE run_dir={run_dir}")
    try:
        final = json.loads((run_dir / "final.json").read_text())
    except (OSError, ValueError):
        return ""  # the driver died before writing it (kill -9): resumable
    status = str(final.get("status", ""))
    if (status == "completed" or status.startswith(NOTHING_LEARNED)) and int(final.get("versions", 0)) >= budget_versions:
        return (f"{run_dir} is completed ({final.get('versions')} of {final.get('budget_versions')} versions): "
                f"nothing to resume. To train further, resume with a larger budget: "
                f"tidal run --resume {run_dir} budget.versions=N")
    return ""
