"""What became of the training groups the workers settled: trained (whole or on survivors) or dropped, by
reason and by the failure's own text, so that a run that cannot train says why in one line.

The text is the worker's `Ack.detail`: for an episode that failed, the failure's own message (a verifier
error carries the author's, e.g. ``outcome() returned nan (float), not a real number (env unitconv,
unitconv_tidal/env.py:82)``). The most frequent one is the run's top cause.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


def reason_words(reason: str, n: int = 2) -> str:
    """`verifier_error` -> "verifier errors": a reason as the status line says it."""
    words = reason.replace("_", " ")
    return words + "s" if n != 1 and words.endswith("error") else words


@dataclass
class Drops:
    window_s: float = 60.0  # the window of the drop rate
    trained: int = 0  # groups that reached the buffer (whole, or on their survivors)
    dropped: int = 0
    samples_left_out: int = 0  # failed episodes of groups trained on their survivors
    by_reason: Counter[str] = field(default_factory=Counter)
    # (reason, failure text) -> the groups and episodes it cost
    causes: Counter[tuple[str, str]] = field(default_factory=Counter)
    recent: deque[tuple[float, bool]] = field(default_factory=deque)  # (monotonic time, dropped) per group

    def settled(self, ok: bool, reason: str, detail: str, left_out: int = 0, now: float | None = None) -> None:
        """One training group settled by its worker: trained (`ok`, maybe without `left_out` samples) or dropped."""
        now = time.monotonic() if now is None else now
        if ok:
            self.trained += 1
            self.samples_left_out += left_out
        else:
            self.dropped += 1
            self.by_reason[reason or "unspecified"] += 1
        if detail and (not ok or left_out):
            self.causes[(reason or "unspecified", detail)] += 1
        self.recent.append((now, not ok))
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()

    def rate(self) -> tuple[float, int]:
        """(the share of the window's groups that were dropped, how many groups the window holds)."""
        n = len(self.recent)
        return (sum(d for _, d in self.recent) / n if n else 0.0), n

    def top_cause(self) -> str:
        """The most frequent failure text of the most frequent drop reason (texts of other reasons, or of
        episodes left out of trained groups, when no drop carried one)."""
        top = self.by_reason.most_common(1)[0][0] if self.by_reason else None
        ranked = self.causes.most_common()
        for (reason, text), _ in ranked:
            if reason == top:
                return text
        return ranked[0][0][1] if ranked else "no error text reported"

    def summary(self) -> str:
        """`100 % verifier errors, <the most frequent failure text>`: the top reason's share of the drops."""
        if not self.dropped:
            return "no group was dropped"
        reason, n = self.by_reason.most_common(1)[0]
        return f"{100 * n / self.dropped:.0f} % {reason_words(reason)}, {self.top_cause()}"
