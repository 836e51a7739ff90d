"""An LLM judge as a reward (plugin ``judge``): any OpenAI-compatible endpoint scores each sample by a rubric.

The rubric is a template filled with the task's ``{prompt}``, the sample's ``{completion}`` and the
task's ``{reference}`` (its answer); the judge's reply must hold a score that `score_pattern` finds
(default ``Score: 7``), which is mapped from [`min_score`, `max_score`] to [0, 1]. A rollout worker scores
a judged group's samples on `concurrency` threads at once while it keeps generating (the plugin says so
with its `concurrency` attribute: tidal.rollout.worker.scoring), so a slow judge does not idle the engine.

A timeout, an HTTP error, a refusal or a reply without a score raises `JudgeError`: the sample's group
is dropped and counted (``rollout/groups/dropped/reward_error``), never scored 0. The judge's own counters
reach the worker's metrics: ``reward/judge/calls``, ``reward/judge/errors/<kind>`` (timeout, http,
connection, unparsable, refused), ``reward/judge/latency_ms_median`` and ``reward/judge/calls_per_s``.
The API key, when the endpoint needs one, comes from the environment variable `api_key_env` (never the
recipe). Requests use the standard library (urllib): no client package to install.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

from tidal.core.interfaces import Task

DEFAULT_RUBRIC = (
    "You grade an answer to a task.\n\nTask:\n{prompt}\n\nReference answer (may be empty):\n{reference}\n\n"
    "Answer to grade:\n{completion}\n\nGive a score from 0 (wrong or unhelpful) to 10 (fully correct). "
    "End your reply with a line `Score: N`."
)
DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"


class JudgeError(Exception):
    """The judge gave no score: `kind` is timeout, http, connection, unparsable or refused."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"judge {kind}: {message}")
        self.kind = kind


class Judge:
    """Scores (task, completion) through an OpenAI-compatible `/chat/completions` at `endpoint`."""

    def __init__(self, endpoint: str, model: str = "", rubric: str = DEFAULT_RUBRIC, score_pattern: str = DEFAULT_PATTERN,
                 min_score: float = 0.0, max_score: float = 10.0, timeout_s: float = 60.0, concurrency: int = 8,
                 max_tokens: int = 512, temperature: float = 0.0, api_key_env: str = "OPENAI_API_KEY") -> None:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"judge endpoint {endpoint!r}: an http(s) URL of an OpenAI-compatible API, e.g. "
                             f"http://127.0.0.1:8000/v1 (the judge posts to <endpoint>/chat/completions)")
        if max_score <= min_score:
            raise ValueError(f"judge max_score ({max_score:g}) must be above min_score ({min_score:g})")
        if concurrency < 0 or timeout_s <= 0:
            raise ValueError("judge concurrency must be >= 0 (0: score inline) and timeout_s > 0")
        try:
            rubric.format(prompt="", completion="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"judge rubric: only {{prompt}}, {{completion}} and {{reference}} may be filled in "
                             f"(double other braces): {e!r}") from None
        self.url = endpoint.rstrip("/") + "/chat/completions"
        self.model, self.rubric, self.pattern = model, rubric, re.compile(score_pattern)
        self.min_score, self.max_score = min_score, max_score
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.max_tokens, self.temperature = max_tokens, temperature
        self.api_key = os.environ.get(api_key_env, "") if api_key_env else ""
        self._lock = threading.Lock()
        self.calls = 0
        self.errors: Counter[str] = Counter()
        self._latencies: list[float] = []  # seconds, this metrics window
        self._window = (time.monotonic(), 0)  # (start, calls at start)

    def __call__(self, task: Task, completion: str) -> float:
        t0 = time.monotonic()
        try:
            reply = self._ask(self.rubric.format(prompt=task.prompt, completion=completion, reference=task.answer))
            return self._score(reply)
        except JudgeError as e:
            with self._lock:
                self.errors[e.kind] += 1
            raise
        finally:
            with self._lock:
                self.calls += 1
                self._latencies.append(time.monotonic() - t0)

    def _ask(self, content: str) -> str:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": self.max_tokens,
                "temperature": self.temperature, **({"model": self.model} if self.model else {})}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise JudgeError("http", f"{self.url} answered {e.code} {e.reason}") from None
        except TimeoutError as e:
            raise JudgeError("timeout", f"no answer from {self.url} within {self.timeout_s:g} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise JudgeError("timeout", f"no answer from {self.url} within {self.timeout_s:g} s") from None
            raise JudgeError("connection", f"{self.url}: {e.reason}") from None
        except ValueError as e:
            raise JudgeError("unparsable", f"{self.url} answered something that is not JSON: {e}") from None
        try:
            choice = payload["choices"][0]
            message = choice.get("message") or {}
            if message.get("refusal"):
                raise JudgeError("refused", str(message["refusal"])[:200])
            return str(message.get("content") or choice.get("text") or "")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise JudgeError("unparsable", f"no choices[0].message in the reply: {str(payload)[:200]}") from None

    def _score(self, reply: str) -> float:
        found = self.pattern.findall(reply)
        if not found:
            raise JudgeError("unparsable", f"no score in the judge's reply (pattern {self.pattern.pattern!r}): {reply[-200:]!r}")
        score = float(found[-1])
        if not self.min_score <= score <= self.max_score:
            raise JudgeError("unparsable", f"score {score:g} outside [{self.min_score:g}, {self.max_score:g}]")
        return (score - self.min_score) / (self.max_score - self.min_score)

    def metrics(self) -> dict[str, float]:
        """This judge's counters (cumulative) and its latency and call rate since the last call."""
        now = time.monotonic()
        with self._lock:
            latencies, self._latencies = self._latencies, []
            start, calls_then = self._window
            self._window = (now, self.calls)
            out = {"reward/judge/calls": float(self.calls),
                   "reward/judge/calls_per_s": (self.calls - calls_then) / max(now - start, 1e-9),
                   **{f"reward/judge/errors/{k}": float(n) for k, n in self.errors.items()}}
        if latencies:
            out["reward/judge/latency_ms_median"] = 1e3 * statistics.median(latencies)
        return out
