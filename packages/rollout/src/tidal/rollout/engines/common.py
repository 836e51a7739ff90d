"""What every engine shares on top of submit/poll."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from tidal.core.interfaces import GenerationRequest, GenerationResult


def generate(engine: Any, requests: Iterable[GenerationRequest], timeout: float | None = None
             ) -> Iterator[GenerationResult]:
    """Submit `requests` to `engine` and yield their results as each finishes (not in submission
    order); TimeoutError when some are still running after `timeout` seconds."""
    pending = set()
    for r in requests:
        engine.submit(r)
        pending.add(r.request_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        results = engine.poll(timeout=left)
        if not results and left == 0.0:
            raise TimeoutError(f"{len(pending)} requests still running after {timeout} s")
        for res in results:
            pending.discard(res.request_id)
            yield res
