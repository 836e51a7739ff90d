"""Where a run's numbers go: `metrics.jsonl` (one line per Metrics message), TensorBoard event files,
and a live view (rich on a terminal, one log line every few seconds otherwise).

metrics.jsonl lines: ``{"time", "elapsed", "source", "step", "version", "scalars": {...}}`` plus
``"histograms": {name: [values]}`` when the message had any. `version` is the learner's policy version
when the line was written, so any source can be plotted against versions.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import msgspec

from tidal.core.protocol import Metrics

log = logging.getLogger("tidal.run")


class MetricsSink:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._f = open(self.path, "ab")
        self.t0 = time.time()
        self.version = 0
        self.tb = None
        if tensorboard:
            try:
                # heavy: only a run with monitor.tensorboard on writes event files
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"), flush_secs=10)
            except ImportError:
                log.warning("tensorboardX is not installed: TensorBoard files are not written (metrics.jsonl is)")

    def __call__(self, m: Metrics) -> None:
        if m.source.startswith("learner"):
            self.version = max(self.version, int(m.scalars.get("train/version", self.version)))
        row = {"time": m.time, "elapsed": time.time() - self.t0, "source": m.source, "step": m.step,
               "version": self.version, "scalars": m.scalars}
        if m.histograms:
            row["histograms"] = {k: v.numpy().tolist() for k, v in m.histograms.items()}
        self._f.write(msgspec.json.encode(row) + b"\n")
        self._f.flush()
        if self.tb is not None:
            prefix = "" if m.source.startswith("learner") or m.source == "controller" else f"{m.source}/"
            step = m.step if m.source.startswith("learner") or m.source == "controller" else self.version
            for k, v in m.scalars.items():
                self.tb.add_scalar(prefix + k, v, step, walltime=m.time)
            for k, h in m.histograms.items():
                values = h.numpy()
                if values.size:
                    self.tb.add_histogram(prefix + k, values, step, walltime=m.time)

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a tidal run folder?")
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            rows.append(msgspec.json.decode(line))
        except msgspec.DecodeError:
            continue  # a line cut by a crash
    return rows


class Display:
    """The live view: version, samples/s, tokens/s, reward, eval accuracy, buffer depth, lag."""

    def __init__(self, mode: str, target_versions: int, log_every_s: float = 10.0) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "log"
        self.mode = mode
        self.target = target_versions
        self.log_every_s = log_every_s
        self._next_log = 0.0
        self._live = None
        self._progress = None
        if mode == "rich":
            # heavy: only the live display (monitor.progress = rich) needs rich
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]policy version"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn())
            self._task = self._progress.add_task("versions", total=target_versions)
            self._live = Live(self._render({}), refresh_per_second=4, transient=False)
            self._live.start()

    def _render(self, s: dict[str, str]):
        # heavy: only the live display (monitor.progress = rich) needs rich
        from rich.console import Group
        from rich.table import Table

        t = Table.grid(padding=(0, 3))
        for _ in range(4):
            t.add_column()
        items = list(s.items())
        for i in range(0, len(items), 4):
            t.add_row(*[f"[dim]{k}[/dim] {v}" for k, v in items[i:i + 4]])
        return Group(self._progress, t) if self._progress is not None else t

    def update(self, version: int, summary: dict[str, str]) -> None:
        if self.mode == "rich" and self._live is not None and self._progress is not None:  # made together
            self._progress.update(self._task, completed=min(version, self.target))
            self._live.update(self._render(summary))
        elif self.mode == "log" and time.monotonic() >= self._next_log:
            self._next_log = time.monotonic() + self.log_every_s
            # printed, not logged: a driver's output that is not a terminal (CI, `| tee`, nohup) still
            # shows progress, whether or not the caller configured logging
            print(f"      version {version}/{self.target}  " + "  ".join(f"{k} {v}" for k, v in summary.items()),
                  flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
