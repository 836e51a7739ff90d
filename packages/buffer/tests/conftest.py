"""Real buffer processes for tests: started on free loopback ports, killed (-9) or stopped on demand,
and always cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tidal.buffer.client import BatchClient
from tidal.core.testing import free_endpoint, stop_process

HERE = Path(__file__).parent


class BufferProcess:
    def __init__(self, tmp: Path, **settings) -> None:
        self.tmp = tmp
        self.ingest, self.serve, self.publish = free_endpoint(), free_endpoint(), free_endpoint()
        self.settings = {"wal_dir": str(tmp / "wal"), "metrics_interval_s": 0.5, **settings}
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def args(self) -> list[str]:
        out = [f"ingest={self.ingest!r}", f"serve={self.serve!r}", f"publish={self.publish!r}"]
        for k, v in self.settings.items():
            out.append(f"{k}={v!r}" if isinstance(v, str) else f"{k}={_toml(v)}")
        return [a.replace("'", '"') for a in out]

    def start(self) -> None:
        log = self.tmp / f"buffer-{len(self.logs)}.log"
        self.logs.append(log)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.buffer", *self.args()], stdout=open(log, "w"), stderr=subprocess.STDOUT,
        )
        with BatchClient(self.serve) as probe:  # ready when it answers
            deadline = time.monotonic() + 60
            while True:
                try:
                    probe.status(timeout=1.0)
                    return
                except TimeoutError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"buffer did not start:\n{self.log_text()}") from None

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)

    def log_text(self) -> str:
        return "\n".join(p.read_text() for p in self.logs if p.exists())

    def wait_status(self, holds: Callable[[dict[str, float]], bool], timeout: float, what: str) -> dict[str, float]:
        """The buffer's status scalars once `holds` says yes; fails naming `what` (and the last status)
        after `timeout`."""
        deadline = time.monotonic() + timeout
        with BatchClient(self.serve) as probe:
            while True:
                s = probe.status(timeout=10).scalars
                if holds(s):
                    return s
                if time.monotonic() > deadline:
                    raise AssertionError(f"the buffer's status never showed {what} within {timeout:g} s: {s}")
                time.sleep(0.05)


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


@pytest.fixture
def buffer_process(tmp_path) -> Iterator:
    made: list[BufferProcess] = []

    def make(**settings) -> BufferProcess:
        b = BufferProcess(tmp_path, **settings)
        made.append(b)
        b.start()
        return b

    yield make
    for b in made:
        b.stop()


class Producers:
    """Producer processes (producer.py) that push trajectories until every one is acknowledged."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, buf: BufferProcess, name: str, count: int, group_size: int, **opts) -> Path:
        acked = self.tmp / f"{name}.acked"
        cmd = [sys.executable, str(HERE / "producer.py"), buf.ingest, buf.publish, name, str(count),
               str(group_size), str(acked)]
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return acked

    def wait(self, timeout: float) -> None:
        for p in self.procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"producer failed:\n{out}\n{err}"

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def producers(tmp_path) -> Iterator[Producers]:
    p = Producers(tmp_path)
    yield p
    p.kill()



class Learners:
    def __init__(self, endpoint: str, world_size: int = 1, delay: float = 0.0, group_size: int | None = None) -> None:
        self.endpoint = endpoint
        self.world_size = world_size
        self.delay = delay
        self.group_size = group_size
        self.trained: list[str] = []  # every trajectory id trained on, duplicates included
        self.batches: list[tuple[int, str, int]] = []  # (rank, batch id, tokens)
        self.errors: list[BaseException] = []
        self.incomplete_groups: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.version = 0
        self.threads = [threading.Thread(target=self._run, args=(r,), daemon=True) for r in range(world_size)]

    def start(self) -> Learners:
        for t in self.threads:
            t.start()
        return self

    def _run(self, rank: int) -> None:
        try:
            with BatchClient(self.endpoint, rank, self.world_size, retry_every=0.5) as client:
                while not self._stop.is_set():
                    try:
                        batch = client.next_batch(self.version, timeout=1.0)
                    except TimeoutError:
                        continue
                    ids = [t.id for t in batch.trajectories]
                    if self.group_size:
                        counts = Counter(t.group_id for t in batch.trajectories)
                        self.incomplete_groups += [g for g, c in counts.items() if c != self.group_size]
                    time.sleep(self.delay)
                    with self._lock:
                        self.trained.extend(ids)
                        self.batches.append((rank, batch.batch_id, batch.num_tokens))
                        if rank == 0:
                            self.version += 1
                    client.ack(batch.batch_id, timeout=120)
        except BaseException as e:  # surfaced by the test
            self.errors.append(e)

    def wait_for(self, n: int, timeout: float) -> None:
        """Until the learners have trained `n` trajectories; a learner's error, or `timeout`, fails the test
        (saying how far they got) instead of returning with less."""
        deadline = time.monotonic() + timeout
        while len(self.trained) < n and time.monotonic() < deadline and not self.errors:
            time.sleep(0.1)
        if self.errors:
            raise AssertionError(f"a learner failed after {len(self.trained)} trajectories: {self.errors[0]!r}")
        if len(self.trained) < n:
            raise AssertionError(f"learners trained {len(self.trained)} of {n} trajectories within {timeout:g} s")

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture
def make_learners():
    made: list[Learners] = []

    def make(*args, **kw) -> Learners:
        ln = Learners(*args, **kw).start()
        made.append(ln)
        return ln

    yield make
    for ln in made:
        ln.stop()
