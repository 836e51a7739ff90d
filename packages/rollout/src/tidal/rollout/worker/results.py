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
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from tidal.core.arrays import Array
from tidal.core.channels import Waker
from tidal.core.interfaces import GenerationRequest, GenerationResult
from tidal.core.protocol import BASELINE_KEY, Assignment, SamplingParams, Trajectory, trajectory_id

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


def sample_seed(group_id: str, index: int, base: int | None) -> int:
    """The seed of one sample: from the assignment's seed when given, else from the group id."""
    if base is not None:
        return base + index
    return zlib.crc32(trajectory_id(group_id, index).encode()) & 0x7FFFFFFF


def is_baseline(a: Assignment, index: int) -> bool:
    """Whether sample `index` is its group's greedy baseline member (ReMax: `BASELINE_KEY`, the last one)."""
    return a.metadata.get(BASELINE_KEY) == "greedy" and index == a.num_samples - 1


def member_sampling(a: Assignment, index: int) -> SamplingParams:
    """How sample `index` of `a` is drawn: the assignment's sampling with its own seed, or greedy decoding
    (temperature 0, no top-k / top-p) for the greedy baseline member."""
    sampling = msgspec.structs.replace(a.sampling, seed=sample_seed(a.group_id, index, a.sampling.seed))
    return _greedy(sampling) if is_baseline(a, index) else sampling


def _greedy(sampling: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(sampling, temperature=0.0, top_k=-1, top_p=1.0)


def iter_requests(assignment: Assignment) -> Iterator[GenerationRequest]:
    """The G generation requests of an assignment, as the worker submits them (for other drivers)."""
    prompt = [int(x) for x in assignment.prompt_ids.numpy()]
    for i in range(assignment.num_samples):
        yield GenerationRequest(request_id=trajectory_id(assignment.group_id, i), prompt_ids=prompt,
                                sampling=member_sampling(assignment, i))


def trajectory_of(a: Assignment, index: int, res: GenerationResult, reward: float, source: str) -> Trajectory:
    """Sample `index` of assignment `a`, generated as `res` and scored `reward`, as the buffer takes it. A
    greedy baseline member is never trained (loss_mask 0) and alone keeps `BASELINE_KEY` in its metadata."""
    n = len(res.completion_ids)
    baseline = is_baseline(a, index)
    metadata = dict(a.metadata)
    if not baseline:
        metadata.pop(BASELINE_KEY, None)
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
        loss_mask=Array.from_numpy(np.zeros(n, np.uint8)) if baseline else None,
        metadata=metadata, source=source, group_size=a.num_samples,
        # the learner recomputes logprobs under the same processing
        sampling=_greedy(a.sampling) if baseline else a.sampling,
    )
