"""What a rollout worker builds per domain (its environment, its scorer) and how one sample is scored.

A domain (one of the worker's ``domains``, or an env plugin that a task names directly) gets one
environment instance, so one env plugin can serve two domains with different options, and one scorer:
the domain's reward plugin when it names one, else its environment's ``score``. Whatever a plugin
raises while scoring costs the sample's group (`SampleError`, with the reason the worker counts), never
the worker. A scorer with a `concurrency` attribute > 0 (an LLM judge) is called off the worker's loop
(`ConcurrentScoring`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from tidal.core.config import domains_by_key
from tidal.core.episodes import NotAReward, real_reward
from tidal.core.interfaces import GenerationResult, Task
from tidal.core.plugins import registry
from tidal.rollout.worker.config import WorkerConfig


class SampleError(Exception):
    """Scoring or decoding one sample failed: its group is dropped (`reason`), the worker goes on."""

    def __init__(self, reason: str, cause: BaseException) -> None:
        super().__init__(f"{reason}: {type(cause).__name__}: {cause}")
        self.reason, self.cause = reason, cause


class Domains:
    def __init__(self, cfg: WorkerConfig, tokenizer: Any | None) -> None:
        domains_by_key(cfg.domains)  # a domain listed twice is refused at the worker's start
        self.cfg, self.tokenizer = cfg, tokenizer
        self._envs: dict[str, Any] = {}
        self._scorers: dict[str, Any] = {}

    def env(self, name: str) -> Any:
        """The environment instance of domain `name`, built on first use."""
        if name not in self._envs:
            env = self.cfg.domain(name).env
            self._envs[name] = registry.build("env", env.name, env.options, field=f"domains[{name}].env")
        return self._envs[name]

    def scorer(self, name: str) -> Any:
        """What scores domain `name`: its reward plugin when it names one, else its env's `score`."""
        if name not in self._scorers:
            reward = self.cfg.domain(name).reward
            if reward is not None:
                self._scorers[name] = registry.build("reward", reward.name, reward.options,
                                                     field=f"domains[{name}].reward")
            else:
                self._scorers[name] = self.env(name).score
        return self._scorers[name]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, ids: list[int]) -> str:
        """`ids` decoded for a transcript; tokens the tokenizer cannot decode (a decode_error group) as their ids."""
        try:
            return self.decode(ids)
        except Exception:
            return " ".join(map(str, ids))

    def score(self, domain: str, task: Task, res: GenerationResult) -> float:
        """The reward of one sample of `domain`; SampleError (decode_error, reward_error or score_error)
        when decoding or the plugin fails, or the reward is not a real finite number (`real_reward`)."""
        try:
            text = self.decode(res.completion_ids)
        except Exception as e:
            raise SampleError("decode_error", e) from e
        reason = "reward_error" if self.cfg.domain(domain).reward is not None else "score_error"
        try:
            value = self.scorer(domain)(task, text)
        except Exception as e:
            raise SampleError(reason, e) from e
        try:  # NaN would poison its group's advantages; a string ("1.0") is a verifier's bug, not a reward
            return real_reward(value, "score()" if reason == "score_error" else "the reward plugin")
        except NotAReward as e:
            raise SampleError(reason, ValueError(f"{e}, for completion {text[:80]!r}")) from None


class _Threads:
    """`width` daemon threads running submitted calls (a ThreadPoolExecutor's threads are joined when the
    interpreter exits: a judge call hanging until its timeout would hold a stopping worker that long)."""

    def __init__(self, width: int, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Future, Any, tuple] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(width)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Any, *args: Any) -> Future:
        f: Future = Future()
        self._q.put((f, fn, args))
        return f

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            f, fn, args = item
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn(*args))
                except BaseException as e:
                    f.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)


class ConcurrentScoring:
    """Groups of a domain whose scorer is slow (its `concurrency` attribute > 0: an LLM judge,
    tidal.rollout.judge) are scored off the worker's loop: all of a group's samples at once on that
    scorer's own pool of `concurrency` threads, while the loop goes on generating; `take` hands the loop
    the groups that finished (the waker wakes it). Other domains are scored inline, as before."""

    def __init__(self, domains: Domains, waker: Any) -> None:
        self.domains, self.waker = domains, waker
        self._pools: dict[str, _Threads] = {}
        self._done: deque[tuple[str, list[float] | SampleError]] = deque()
        self._lock = threading.Lock()
        self.in_flight = 0  # groups being scored

    def concurrent(self, domain: str) -> bool:
        """Whether `domain`'s scorer asks to be called off the loop (a scorer that cannot be built fails
        inline, where its error is handled as before)."""
        try:
            return int(getattr(self.domains.scorer(domain), "concurrency", 0) or 0) > 0
        except Exception:
            return False

    def submit(self, key: str, domain: str, task: Task, results: list[GenerationResult]) -> None:
        """Score `results` (one group, in sample order) on `domain`'s pool; the outcome comes out of `take`
        as (key, rewards) or (key, the first SampleError)."""
        if domain not in self._pools:
            width = int(getattr(self.domains.scorer(domain), "concurrency", 1))
            self._pools[domain] = _Threads(width, f"tidal-score-{domain}")
        futures = [self._pools[domain].submit(self.domains.score, domain, task, r) for r in results]
        left = [len(futures)]
        self.in_flight += 1

        def settled(_: Future) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                errors = [f.exception() for f in futures if f.exception() is not None]
                outcome: list[float] | SampleError
                if errors:
                    e = errors[0]
                    outcome = e if isinstance(e, SampleError) else SampleError("reward_error", e or RuntimeError())
                else:
                    outcome = [f.result() for f in futures]
                self._done.append((key, outcome))
            self.waker.wake()

        for f in futures:
            f.add_done_callback(settled)

    def take(self) -> list[tuple[str, list[float] | SampleError]]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        self.in_flight -= len(out)
        return out

    def metrics(self) -> dict[str, float]:
        """The metrics of every scorer that reports its own (a judge's calls, errors, latency)."""
        out: dict[str, float] = {"rollout/scoring_in_flight": float(self.in_flight)} if self._pools else {}
        for domain in self._pools:
            report = getattr(self.domains.scorer(domain), "metrics", None)
            if callable(report):
                out.update(report())
        return out

    def close(self) -> None:
        for pool in self._pools.values():  # calls under way are abandoned with their groups
            pool.close()
