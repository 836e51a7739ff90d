"""A simulated engine for pipeline benchmarks (engine plugin ``simulated``): the real rollout worker,
buffer, learner and weight transfer around it, only the cost of generation replaced by sleeping.

It behaves like a continuous-batching engine: up to `max_num_seqs` sequences advance one token per
decode step, and a step takes `token_s` seconds however many sequences share it (decoding is memory
bound). Completion lengths are drawn per request from a long-tailed distribution (log-normal, capped at
`max_tokens`), seeded by the request seed, so a sync batch waits for its longest member while an async
engine keeps every slot busy. Weight updates are fetched through the announced transport for real (the
bytes travel and are verified) and then dropped; with `fetch_weights=False` the announced version is
taken without moving the bytes, which keeps torch (~300 MB of private memory per process) out of the
worker, so one machine hosts hundreds of them (tools/bench/control_plane.py).
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tidal.core.interfaces import GenerationRequest, GenerationResult
from tidal.core.protocol import WeightsAvailable
from tidal.rollout.engines.weights import ReceiverPool


class SimulatedEngine:
    def __init__(self, model: Any = None, *, token_s: float = 0.01, max_num_seqs: int = 64, median_tokens: int = 32,
                 sigma: float = 1.0, vocab: int = 16, seed: int = 0, version: int = 0,
                 fetch_weights: bool = True,
                 weight_transport_options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.token_s, self.max_num_seqs = token_s, max_num_seqs
        self.median, self.sigma, self.vocab, self.seed = median_tokens, sigma, vocab, seed
        self._version = version
        self._waiting: list[tuple[GenerationRequest, int]] = []
        self._running: dict[str, dict] = {}
        self._out: queue.Queue[GenerationResult] = queue.Queue()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # an idle engine sleeps on it until a request comes
        self._stop = threading.Event()
        self._paused = False
        self.fetch_weights = fetch_weights
        if fetch_weights:
            # the weight receivers need torch, which a real engine's process has loaded before its first
            # update: loaded here too, at start, or the first update would wait ~4 s for the import (the
            # gate stays shut meanwhile) where no real run does
            import torch  # noqa: F401

        self._receivers: ReceiverPool | None = None  # made by the first receive_weights
        self._options = {k: dict(v) for k, v in (weight_transport_options or {}).items()}
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="sim-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def length_of(self, request: GenerationRequest) -> int:
        seed = request.sampling.seed if request.sampling.seed is not None else hash(request.request_id)
        rng = random.Random(seed * 7919 + self.seed)
        n = math.ceil(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return max(1, min(request.sampling.max_tokens, n))

    def submit(self, request: GenerationRequest) -> None:
        with self._lock:
            self._waiting.append((request, self.length_of(request)))
            self._work.notify()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                paused = self._paused
                while not paused and self._waiting and len(self._running) < self.max_num_seqs:
                    req, n = self._waiting.pop(0)
                    self._running[req.request_id] = {"req": req, "left": n, "ids": [], "versions": []}
                busy = bool(self._running) and not paused
            if not busy:
                with self._lock:  # paused, or nothing to run: until submit, resume or close wakes it
                    if not self._stop.is_set() and (self._paused or not self._waiting):
                        self._work.wait(0.5)
                continue
            time.sleep(self.token_s)  # one decode step for every running sequence
            with self._lock:
                self.steps += 1
                rng = random.Random(self.steps)
                for rid, s in list(self._running.items()):
                    s["ids"].append(rng.randrange(self.vocab))
                    s["versions"].append(self._version)
                    s["left"] -= 1
                    if s["left"] == 0:
                        del self._running[rid]
                        n = len(s["ids"])
                        finish = "length" if n >= s["req"].sampling.max_tokens else "stop"
                        self._out.put(GenerationResult(request_id=rid, completion_ids=s["ids"], logprobs=[-1.0] * n,
                                                       versions=s["versions"], finish_reason=finish))

    def poll(self, timeout: float | None = None) -> list[GenerationResult]:
        out = []
        try:
            out.append(self._out.get(timeout=timeout) if timeout else self._out.get_nowait())
            while True:
                out.append(self._out.get_nowait())
        except queue.Empty:
            pass
        return out

    def update_weights(self, weights: Any, version: int) -> None:
        with self._lock:
            self._version = version

    def receive_weights(self, announcement: WeightsAvailable) -> int:
        if not self.fetch_weights:  # the control plane only: the version, without the bytes
            self.update_weights(None, announcement.version)
            return announcement.version
        if self._receivers is None:
            self._receivers = ReceiverPool(self._options)
        return self._receivers.receive(announcement, lambda _named: self.update_weights(None, announcement.version))

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._work.notify()

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            for rid in request_ids:
                s = self._running.pop(rid, None)
                if s is not None:
                    self._out.put(GenerationResult(request_id=rid, completion_ids=s["ids"], logprobs=[-1.0] * len(s["ids"]),
                                                   versions=s["versions"], finish_reason="abort"))

    def load_state(self) -> Mapping[str, float]:
        with self._lock:
            return {"running": float(len(self._running)), "waiting": float(len(self._waiting)),
                    "steps": float(self.steps)}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._work.notify()
        self._thread.join(timeout=5)
