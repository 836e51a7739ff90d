"""Engine results handed to the worker's loop the moment they exist, and made into trajectories.

The worker's loop waits on its sockets (controller, weights, buffer acks). A thread of this module waits
on the engine (`engine.poll`, any engine plugin) and, when results arrive, queues them and wakes the loop
through a `Waker`, so a finished group is scored and sent to the buffer at once rather than at the loop's
next timeout. An engine that fails is reported through `take()`, which raises its error. A scored result
becomes a `Trajectory` through `trajectory_of`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from tidal.core.arrays import Array
from tidal.core.channels import Waker
from tidal.core.interfaces import GenerationResult
from tidal.core.protocol import Assignment, Trajectory, trajectory_id

log = logging.getLogger(__name__)


class ResultForwarder:
    def __init__(self, engine: Any, waker: Waker, *, wait_s: float = 0.2) -> None:
        self.engine, self.waker, self.wait_s = engine, waker, wait_s
        self._lock = threading.Lock()
        self._results: list[GenerationResult] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.engine.poll(timeout=self.wait_s)
            except BaseException as e:  # the engine died: the loop raises it from take()
                if not self._stop.is_set():
                    with self._lock:
                        self._error = e
                    self.waker.wake()
                return
            if got:
                with self._lock:
                    self._results.extend(got)
                self.waker.wake()

    def take(self) -> list[GenerationResult]:
        """The results that arrived since the last call; raises the engine's error once it failed."""
        with self._lock:
            out, self._results = self._results, []
            if self._error is not None and not out:
                raise self._error
        return out

    def close(self) -> None:
        """Stop the thread (within `wait_s`); results it has not handed over are dropped, as the groups they
        belong to are when a worker stops."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.wait_s + 5)


def trajectory_of(a: Assignment, index: int, res: GenerationResult, reward: float, source: str) -> Trajectory:
    """Sample `index` of assignment `a`, generated as `res` and scored `reward`, as the buffer takes it."""
    return Trajectory(
        id=trajectory_id(a.group_id, index), group_id=a.group_id, sample_index=index, task=a.task,
        prompt_ids=a.prompt_ids,
        completion_ids=Array.from_numpy(np.asarray(res.completion_ids, np.int32)),
        logprobs=Array.from_numpy(np.asarray(res.logprobs, np.float32)),
        versions=Array.from_numpy(np.asarray(res.versions, np.int32)),
        kv_versions=None if res.kv_versions is None else Array.from_numpy(np.asarray(res.kv_versions, np.int32)),
        reward=reward, finish_reason=res.finish_reason,
        sampling_mask=None if res.sampling_mask is None else Array.from_numpy(np.ascontiguousarray(res.sampling_mask)),
        routing=None if res.routing is None else Array.from_numpy(np.ascontiguousarray(res.routing, dtype=np.int16)),
        metadata=dict(a.metadata), source=source, group_size=a.num_samples,
        sampling=a.sampling,  # the learner recomputes logprobs under the same processing
    )
