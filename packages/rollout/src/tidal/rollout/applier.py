"""New weights applied to a rollout worker's engine on a thread of their own, newest first.

Announcements (`WeightsAvailable`) arrive on the worker's loop from the controller or the weights
publisher; `announce` keeps only the newest, and the thread applies it through the engine's
`receive_weights` while generation goes on. Each apply wakes the worker's loop (a `Waker`), which reports
the new version to the controller at once (`take_applied`): the depth gate opens on that report, not on
the next heartbeat. A version the engine refuses (a bad transfer, a checksum) is logged and counted, and
the engine keeps generating on the weights it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tidal.core.channels import Waker
from tidal.core.protocol import WeightsAvailable

log = logging.getLogger("tidal.rollout.worker")


class WeightApplier:
    def __init__(self, engine: Any, waker: Waker, name: str) -> None:
        self.engine, self.waker, self.name = engine, waker, name
        self.updates = 0  # versions applied
        self.failures = 0  # versions refused
        self.applied_at = 0.0  # wall clock of the last apply (the controller measures apply -> grant)
        self._latest: WeightsAvailable | None = None
        self._cond = threading.Condition()
        self._applied = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-weights", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def announce(self, ann: WeightsAvailable) -> None:
        """Apply `ann` next, unless a newer version is already waiting."""
        with self._cond:
            if self._latest is None or ann.version > self._latest.version:
                self._latest = ann
                self._cond.notify()

    def take_applied(self) -> bool:
        """True once after each apply: the loop reports the new version."""
        if self._applied.is_set():
            self._applied.clear()
            return True
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while self._latest is None and not self._stop.is_set():
                    self._cond.wait(0.5)
                ann, self._latest = self._latest, None
            if ann is None or ann.version <= self.engine.version:
                continue
            t0 = time.perf_counter()
            try:
                held = self.engine.receive_weights(ann)
            except Exception as e:  # keep generating on the old weights; the sender has been told
                self.failures += 1
                log.error("%s: weights version %d rejected, keeping version %d: %s", self.name, ann.version,
                          self.engine.version, e)
                continue
            self.applied_at = time.time()
            self._applied.set()
            self.waker.wake()
            self.updates += 1
            log.info("%s: weights version %d applied in %.1f ms", self.name, held, (time.perf_counter() - t0) * 1e3)

    def stop(self) -> None:
        """Apply nothing more (an apply in progress finishes); returns at once."""
        self._stop.set()
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Stop the thread; an apply in progress is waited for up to `timeout` s."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
