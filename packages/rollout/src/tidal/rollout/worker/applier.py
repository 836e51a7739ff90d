"""New weights applied to a rollout worker's engine on a thread of their own, newest first.

Announcements (`WeightsAvailable`) arrive on the worker's loop from the controller or the weights
publisher; `announce` keeps only the newest, and the thread applies it through the engine's
`receive_weights` while generation goes on. Each apply wakes the worker's loop (a `Waker`), which reports
the new version to the controller at once (`take_applied`): the depth gate opens on that report, not on
the next heartbeat. A version the engine refuses (a bad transfer, a checksum) is logged and counted, and
the engine keeps generating on the weights it holds.

A learner that dies mid-fetch leaves the fetch waiting on a sender that will never answer. When an
announcement comes in that is not the one being fetched but has the same or a lower version (a restarted
learner: it resumed from a checkpoint), the fetch in progress is cancelled at once (the engine's
`cancel_receive`, where it has one) and the new announcement fetched next. A transport that sees its
sender go away (zmq: the connection drops) ends the fetch by itself (`WeightSenderGone`, a warning). A version given up this way,
or refused by a sender that no longer holds it while a newer one waits, is expected: logged at INFO, not
counted as a failure.
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
        self._fetching: WeightsAvailable | None = None  # the announcement being fetched now
        self.cancelled = 0  # fetches given up for a restarted learner's announcement
        self._cond = threading.Condition()
        self._applied = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-weights", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def announce(self, ann: WeightsAvailable) -> None:
        """Apply `ann` next, unless a newer version is already waiting."""
        with self._cond:
            pending = self._fetching
            replaced = pending is not None and ann != pending and ann.version <= pending.version
            if replaced or self._latest is None or ann.version > self._latest.version:
                self._latest = ann
                self._cond.notify()
        if replaced and pending is not None:  # the sender of `pending` was replaced: stop waiting on it
            cancel = getattr(self.engine, "cancel_receive", None)
            if cancel is not None:
                log.info("%s: version %d announced while fetching version %d (a restarted learner): "
                         "giving up that fetch", self.name, ann.version, pending.version)
                cancel()

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
                self._fetching = ann
            t0 = time.perf_counter()
            try:
                held = self.engine.receive_weights(ann)
            except Exception as e:  # keep generating on the old weights; the sender has been told
                with self._cond:
                    self._fetching = None
                    newer = self._latest
                if type(e).__name__ == "WeightFetchCancelled":  # asked for (announce): fetch the new one
                    self.cancelled += 1
                    log.info("%s: fetch of version %d given up; next: version %s", self.name, ann.version,
                             newer.version if newer is not None else "(the next announcement)")
                elif type(e).__name__ == "WeightSenderGone":  # the learner died mid-fetch: a restart follows
                    self.cancelled += 1
                    log.warning("%s: %s; keeping version %d, fetching the next announcement (a restarted "
                                "learner's)", self.name, e, self.engine.version)
                elif newer is not None and newer.version > ann.version and "is not held" in str(e):
                    # the sender moved past this version while we fetched it: expected, the newer one is next
                    log.info("%s: version %d no longer served (version %d is next)", self.name, ann.version,
                             newer.version)
                else:
                    self.failures += 1
                    log.error("%s: weights version %d rejected, keeping version %d: %s", self.name, ann.version,
                              self.engine.version, e)
                continue
            with self._cond:
                self._fetching = None
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
