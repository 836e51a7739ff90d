"""What every engine shares on top of submit/poll."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from tidal.core.interfaces import GenerationRequest, GenerationResult
from tidal.core.protocol import SamplingParams


def generate(engine: Any, requests: Iterable[GenerationRequest], timeout: float | None = None
             ) -> Iterator[GenerationResult]:
    """Submit `requests` to `engine` and yield their results as each finishes (not in submission
    order); TimeoutError when some are still running after `timeout` seconds."""
    requests = list(requests)
    submit_all(engine, requests)
    pending = {r.request_id for r in requests}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        results = engine.poll(timeout=left)
        if not results and left == 0.0:
            raise TimeoutError(f"{len(pending)} requests still running after {timeout} s")
        for res in results:
            pending.discard(res.request_id)
            yield res


def submit_all(engine: Any, requests: list[GenerationRequest]) -> None:
    """Submit `requests` at once where the engine can take them together (`submit_many`: the embedded
    engine then prefills a group's shared prompt once), else one by one."""
    many = getattr(engine, "submit_many", None)
    if many is not None:
        many(requests)
        return
    for r in requests:
        engine.submit(r)


def warm_up(engine: Any, n: int, timeout: float | None = None) -> float:
    """`n` samples of a 16-token prompt (token ids 1 and 2), 4 tokens each, through `engine`, nothing
    kept: its first-call costs (allocations, kernel choices) paid now. Returns the milliseconds taken."""
    t0 = time.perf_counter()
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
    reqs = [GenerationRequest(request_id=f"warmup-{i}", prompt_ids=[1 + j % 2 for j in range(16)], sampling=sampling)
            for i in range(n)]
    for _ in generate(engine, reqs, timeout):
        pass
    return (time.perf_counter() - t0) * 1e3
