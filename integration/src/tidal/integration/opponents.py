"""Opponent samplers of self-play runs: who plays the seats the live (trained) policy does not.

The controller asks its sampler for the opponent of each group of episodes (`pick`), tells it the live
policy's score in each episode of that group (`record`: > 0 a win, < 0 a loss, 0 a draw or anything
else), tells it of each frozen snapshot the learner saved (`add`, for the versions it said to `keep`),
deletes the snapshots it no longer lists (`snapshots`), and writes its `state()` as JSON into the run
folder, to `load` it again when the run restarts.

An opponent is a name: ``"live"`` (the live policy itself in the other seats: mirror self-play),
``"v<N>"`` (the frozen snapshot of policy version N, e.g. ``"v12"``), ``"scripted"`` (the environment's
scripted player).

The pool rates the live policy and its snapshots with openskill's Plackett-Luce model (Weng & Lin 2011)
and samples by prioritised fictitious self-play (PFSP, Vinyals et al. 2019, AlphaStar). Plackett-Luce
rather than Thurstone-Mosteller: it is openskill's default and best-tested model, its updates need no
draw-margin parameter (a tie is a shared rank), and its `predict_win` is the same normal-CDF formula as
the other models', so the PFSP weights do not depend on the choice.
"""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any, Protocol

from openskill.models import PlackettLuce, PlackettLuceRating

LIVE = "live"
SCRIPTED = "scripted"
_SNAPSHOT = re.compile(r"v(0|[1-9][0-9]*)")
_AGAINST = ("pool", "live", "scripted")  # the groups of results the win-rate metrics report


def snapshot_opponent(version: int) -> str:
    """The opponent name of the frozen snapshot of `version`: ``"v<version>"``."""
    return f"v{version}"


def snapshot_version(opponent: str) -> int | None:
    """N of ``"v<N>"``; None for ``"live"`` and ``"scripted"``; a ValueError for any other name."""
    if opponent in (LIVE, SCRIPTED):
        return None
    m = _SNAPSHOT.fullmatch(opponent)
    if m is None:
        raise ValueError(f"opponent {opponent!r} is none of 'live', 'scripted', 'v<version>' (e.g. 'v12')")
    return int(m.group(1))


class OpponentSampler(Protocol):
    """Who plays the other seats of each group; what the controller of a self-play run talks to."""

    def pick(self, live_version: int, rng: random.Random) -> str:
        """The opponent of the next group, the live policy being at `live_version`."""
        ...

    def keep(self, version: int) -> bool:
        """Whether the run should save a frozen snapshot of policy `version` for this sampler."""
        ...

    def add(self, version: int) -> None:
        """A snapshot of `version` now exists on disk."""
        ...

    def drop(self, version: int) -> None:
        """The snapshot of `version` is gone (deleted, unreadable): never pick it again."""
        ...

    def record(self, opponent: str, scores: list[float]) -> None:
        """The live policy's score in each episode of a group against `opponent`."""
        ...

    def snapshots(self) -> list[int]:
        """The versions whose snapshots it still wants on disk; the run may delete the others."""
        ...

    def state(self) -> dict[str, Any]:
        """All it knows, JSON-able, for `load` after a restart."""
        ...

    def load(self, state: dict[str, Any]) -> None:
        """Take back what `state()` returned (after a round trip through JSON)."""
        ...

    def metrics(self) -> dict[str, float]:
        """``selfplay/...`` values for the run's plots."""
        ...


def _integer(option: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option} must be an integer >= {low}, got {value!r}")


def _one_of(option: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _points(score: float) -> float:
    """A score as the win-rate metrics count it: a win 1, a draw half, a loss 0."""
    return 1.0 if score > 0 else 0.0 if score < 0 else 0.5


class _Sampler:
    """What every sampler shares: the recent picks and results behind its metrics, and their state."""

    kind = ""  # its plugin name, written into its state so that another sampler refuses to load it

    def __init__(self, window: int) -> None:
        _integer("window", window, 1)
        self.window = window
        self._picks: deque[bool] = deque(maxlen=window)  # True where the pick was "live"
        self._results: deque[tuple[str, float]] = deque(maxlen=window)  # (one of _AGAINST, points)

    def _picked(self, opponent: str) -> str:
        self._picks.append(opponent == LIVE)
        return opponent

    def _scored(self, opponent: str, scores: list[float]) -> None:
        against = "pool" if snapshot_version(opponent) is not None else opponent
        self._results.extend((against, _points(s)) for s in scores)

    def keep(self, version: int) -> bool:
        return False

    def add(self, version: int) -> None:
        pass

    def drop(self, version: int) -> None:
        pass

    def record(self, opponent: str, scores: list[float]) -> None:
        self._scored(opponent, scores)

    def snapshots(self) -> list[int]:
        return []

    def state(self) -> dict[str, Any]:
        return {"sampler": self.kind, "picks": [int(p) for p in self._picks],
                "results": [[a, p] for a, p in self._results]}

    def load(self, state: dict[str, Any]) -> None:
        if state.get("sampler") != self.kind:
            raise ValueError(f"the saved opponent state is of sampler {state.get('sampler')!r}, this run's is "
                             f"{self.kind!r}: set the recipe's opponent back, or delete the saved state to start afresh")
        self._picks = deque((bool(p) for p in state["picks"]), maxlen=self.window)
        self._results = deque(((a, float(p)) for a, p in state["results"]), maxlen=self.window)

    def metrics(self) -> dict[str, float]:
        out = {}
        if self._picks:
            out["selfplay/pick/live_frac"] = sum(self._picks) / len(self._picks)
        for against in _AGAINST:
            points = [p for a, p in self._results if a == against]
            if points:
                out[f"selfplay/win_rate/vs_{against}"] = sum(points) / len(points)
        return out


class MirrorSampler(_Sampler):
    """Always the live policy itself ("live"): mirror self-play. Keeps no snapshots.

    window: how many recent picks and episodes the metrics are over."""

    kind = "mirror"

    def __init__(self, window: int = 200) -> None:
        super().__init__(window)

    def pick(self, live_version: int, rng: random.Random) -> str:
        return self._picked(LIVE)


class FixedSampler(_Sampler):
    """Always `opponent`: "scripted" (the environment's player) or "v<N>" (the snapshot of version N;
    "live" until the run has added it, as version N may not exist yet).

    window: how many recent picks and episodes the metrics are over."""

    kind = "fixed"

    def __init__(self, opponent: str = SCRIPTED, window: int = 200) -> None:
        super().__init__(window)
        if opponent == LIVE:
            raise ValueError("opponent 'live' is mirror self-play: use the opponent sampler 'mirror' instead")
        try:
            self._version = snapshot_version(opponent)
        except ValueError:
            raise ValueError(f"opponent must be 'scripted' or 'v<version>' (e.g. 'v12'), got {opponent!r}") from None
        self.opponent = opponent
        self._present = False  # whether the snapshot (if it is one) exists on disk

    def pick(self, live_version: int, rng: random.Random) -> str:
        return self._picked(self.opponent if self._version is None or self._present else LIVE)

    def keep(self, version: int) -> bool:
        return version == self._version

    def add(self, version: int) -> None:
        self._present = self._present or version == self._version

    def drop(self, version: int) -> None:
        self._present = self._present and version != self._version

    def snapshots(self) -> list[int]:
        return [] if self._version is None else [self._version]

    def state(self) -> dict[str, Any]:
        return {**super().state(), "present": self._present}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self._present = bool(state["present"])


class LaggedSampler(_Sampler):
    """The snapshot `k` versions behind the live policy: the newest known one with version <=
    live_version - k; "live" while none exists yet.

    every: keep a snapshot of each version that is a multiple of it (0 included).
    window: how many recent picks and episodes the metrics are over."""

    kind = "lagged"

    def __init__(self, k: int = 4, every: int = 1, window: int = 200) -> None:
        super().__init__(window)
        _integer("k", k, 1)
        _integer("every", every, 1)
        self.k, self.every = k, every
        self._known: list[int] = []  # snapshots on disk, ascending: the one picked now and the newer ones
        self._live = -1  # the newest live version it has seen

    def _target(self, live_version: int) -> int | None:
        return max((v for v in self._known if v <= live_version - self.k), default=None)

    def _prune(self) -> None:
        # older ones than today's pick are never picked again: the live version only grows
        target = self._target(self._live)
        if target is not None:
            self._known = [v for v in self._known if v >= target]

    def pick(self, live_version: int, rng: random.Random) -> str:
        self._live = max(self._live, live_version)
        self._prune()
        target = self._target(live_version)
        return self._picked(LIVE if target is None else snapshot_opponent(target))

    def keep(self, version: int) -> bool:
        return version >= 0 and version % self.every == 0

    def add(self, version: int) -> None:
        if self.keep(version) and version not in self._known:
            self._known = sorted([*self._known, version])
            self._live = max(self._live, version)  # a snapshot of it exists: the live policy got that far
            self._prune()

    def drop(self, version: int) -> None:
        self._known = [v for v in self._known if v != version]

    def snapshots(self) -> list[int]:
        return list(self._known)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "known": list(self._known), "live": self._live}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self._known, self._live = sorted(int(v) for v in state["known"]), int(state["live"])


class PoolSampler(_Sampler):
    """A pool of rated frozen snapshots, sampled by PFSP, with some mirror games.

    every: keep a snapshot of each version that is a multiple of it (0 included).
    size: at most this many snapshots; past it the oldest leaves the pool (and may be deleted).
    rating: the rating system: "openskill" (openskill's Plackett-Luce model; the only one so far).
    rule: "pfsp" weighs snapshot i by f(p_i), p_i the live policy's predicted chance to beat it;
        "uniform" picks snapshots uniformly.
    pfsp_weighting: f: "variance" p(1-p) favours snapshots of about the live policy's strength, "hard"
        (1-p)^2 the stronger ones. Where every weight is 0 (ratings far apart) it picks uniformly.
    live_prob: the share of groups played against the live policy itself (mirror games), which keeps
        the live policy honest against its newest self; the pool is "live" only while it is empty.
    window: how many recent picks and episodes the metrics are over.

    The live policy is rated too, as one entity whose rating moves with every recorded result; a new
    snapshot starts from the live rating of that moment. Results against "live" or "scripted" move no
    rating, and results against a snapshot no longer in the pool are ignored.
    """

    kind = "pool"

    def __init__(self, every: int = 5, size: int = 8, rating: str = "openskill", rule: str = "pfsp",
                 pfsp_weighting: str = "variance", live_prob: float = 0.2, window: int = 200) -> None:
        super().__init__(window)
        _integer("every", every, 1)
        _integer("size", size, 1)
        _one_of("rating", rating, ("openskill",))
        _one_of("rule", rule, ("pfsp", "uniform"))
        _one_of("pfsp_weighting", pfsp_weighting, ("variance", "hard"))
        if isinstance(live_prob, bool) or not isinstance(live_prob, (int, float)) or not 0.0 <= live_prob <= 1.0:
            raise ValueError(f"live_prob must be a number in [0, 1], got {live_prob!r}")
        self.every, self.size, self.rating, self.rule = every, size, rating, rule
        self.pfsp_weighting, self.live_prob = pfsp_weighting, float(live_prob)
        self._model = PlackettLuce()
        self._live: PlackettLuceRating = self._model.rating()
        self._pool: dict[int, PlackettLuceRating] = {}  # version -> rating, ascending versions
        self._weights: tuple[list[int], list[float]] | None = None  # cached; None after any change

    # ------------------------------------------------------------------ sampling

    def _weighted(self) -> tuple[list[int], list[float]]:
        """The pool's versions and their unnormalised weights."""
        if self._weights is None:
            versions = sorted(self._pool)
            weights = [1.0] * len(versions)
            if self.rule == "pfsp":
                p = [self._model.predict_win([[self._live], [self._pool[v]]])[0] for v in versions]
                weights = [q * (1 - q) if self.pfsp_weighting == "variance" else (1 - q) ** 2 for q in p]
                if sum(weights) <= 0.0:
                    weights = [1.0] * len(versions)
            self._weights = (versions, weights)
        return self._weights

    def distribution(self) -> dict[str, float]:
        """The probability of each opponent at the next `pick`."""
        if not self._pool:
            return {LIVE: 1.0}
        versions, weights = self._weighted()
        total = sum(weights)
        return {LIVE: self.live_prob,
                **{snapshot_opponent(v): (1 - self.live_prob) * w / total for v, w in zip(versions, weights, strict=True)}}

    def pick(self, live_version: int, rng: random.Random) -> str:
        if not self._pool or rng.random() < self.live_prob:
            return self._picked(LIVE)
        versions, weights = self._weighted()
        return self._picked(snapshot_opponent(rng.choices(versions, weights)[0]))

    # ------------------------------------------------------------------ the pool

    def keep(self, version: int) -> bool:
        return version >= 0 and version % self.every == 0

    def add(self, version: int) -> None:
        if self.keep(version) and version not in self._pool:
            self._pool[version] = self._model.rating(mu=self._live.mu, sigma=self._live.sigma)
            self._cap()

    def _cap(self) -> None:
        for version in sorted(self._pool)[: max(0, len(self._pool) - self.size)]:
            del self._pool[version]
        self._weights = None

    def drop(self, version: int) -> None:
        self._pool.pop(version, None)
        self._weights = None

    def snapshots(self) -> list[int]:
        return sorted(self._pool)

    def record(self, opponent: str, scores: list[float]) -> None:
        version = snapshot_version(opponent)
        if version is not None and version not in self._pool:
            return
        self._scored(opponent, scores)
        if version is None:
            return
        for score in scores:
            ranks = [1.0, 2.0] if score > 0 else [2.0, 1.0] if score < 0 else [1.0, 1.0]  # lower rank is better
            [live], [snap] = self._model.rate([[self._live], [self._pool[version]]], ranks=ranks)
            self._live, self._pool[version] = live, snap
        self._weights = None

    # ------------------------------------------------------------------ state and metrics

    def state(self) -> dict[str, Any]:
        return {**super().state(), "live": {"mu": self._live.mu, "sigma": self._live.sigma},
                "pool": [{"version": v, "mu": r.mu, "sigma": r.sigma} for v, r in sorted(self._pool.items())]}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self._live = self._model.rating(mu=float(state["live"]["mu"]), sigma=float(state["live"]["sigma"]))
        self._pool = {int(s["version"]): self._model.rating(mu=float(s["mu"]), sigma=float(s["sigma"]))
                      for s in sorted(state["pool"], key=lambda s: s["version"])}
        self._cap()  # a smaller `size` than the saved run's: the oldest go

    def metrics(self) -> dict[str, float]:
        """Also ``selfplay/pool_size`` and ``selfplay/rating/<live or v<N>>``: each rating's mu (not the
        ordinal mu - 3 sigma, which would also move as the uncertainty shrinks)."""
        return {**super().metrics(), "selfplay/pool_size": float(len(self._pool)),
                "selfplay/rating/live": self._live.mu,
                **{f"selfplay/rating/{snapshot_opponent(v)}": r.mu for v, r in sorted(self._pool.items())}}


__all__ = ["LIVE", "SCRIPTED", "FixedSampler", "LaggedSampler", "MirrorSampler", "OpponentSampler", "PoolSampler",
           "snapshot_opponent", "snapshot_version"]
