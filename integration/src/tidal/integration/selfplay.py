"""Self-play in a run: the controller's side of `selfplay.opponent`.

The learner writes a snapshot of the policy every N versions (`learner.snapshot_every`, set from the
opponent sampler's `every`) into ``<run_dir>/snapshots``; `SelfPlay` watches that folder and tells the
sampler of each new one, picks the opponent of each training group of a multi-role domain (its assignment's
``tidal.opponent``), rates the opponents by the live seat's rewards the workers report (`Ack.scores`),
deletes the snapshots the sampler no longer wants, and keeps the sampler's state (pool, ratings) in
``<run_dir>/selfplay.json``, so that a resumed run goes on with them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.core.episodes import snapshot_name
from tidal.core.errors import ConfigError
from tidal.core.plugins import registry

log = logging.getLogger("tidal.selfplay")

STATE = "selfplay.json"
SNAPSHOTS = "snapshots"
_SNAPSHOT = re.compile(r"v(\d+)\.safetensors")
# a snapshot that left the pool is deleted this long after: groups handed out against it just before still
# find it (a worker loads a snapshot when its first game against it starts)
DELETE_AFTER_S = 120.0


def roles_of(env: Any) -> tuple[str, ...]:
    """A multi-role environment's roles (its `roles`, when it has more than one), else ()."""
    roles = tuple(str(r) for r in getattr(env, "roles", ()) or ())
    return roles if len(roles) > 1 else ()


def snapshot_every(sampler: Any) -> int:
    """How often the learner must write snapshots for `sampler` (its `every`; 0: never, as for mirror)."""
    return int(getattr(sampler, "every", 0) or 0)


class SelfPlay:
    """The opponent sampler of a run, fed by its snapshot folder and its workers' results (module docstring)."""

    def __init__(self, opponent: Any, eval_opponent: str, run_dir: Path, domains: Sequence[Any], seed: int) -> None:
        self.sampler = registry.build("opponent", opponent.name, opponent.options, field="selfplay.opponent")
        self.eval_opponent = eval_opponent
        self.folder = run_dir / SNAPSHOTS
        self.state_path = run_dir / STATE
        self.games = {d.name: roles_of(d.env) for d in domains if roles_of(d.env)}
        self.rng = random.Random(seed + 7919)
        self.known: set[int] = set()  # snapshot files seen in the folder
        self._unwanted: dict[int, float] = {}  # snapshot -> when it left the pool (its file goes DELETE_AFTER_S later)
        self._dirty = False
        self._next_scan = 0.0
        if self.state_path.is_file():  # a resumed run: its pool and ratings
            try:
                self.sampler.load(json.loads(self.state_path.read_text()))
            except (ValueError, KeyError, TypeError) as e:  # another sampler's state, or a damaged file
                raise ConfigError(f"{self.state_path}: {e}", field="selfplay.opponent") from None
            log.info("self-play: opponent %s state restored from %s (%s)", opponent.name, self.state_path,
                     _summary(self.sampler))

    def opponent(self, domain: str, live_version: int) -> str | None:
        """The opponent of a training group of `domain` (None: not a multi-role domain)."""
        if domain not in self.games:
            return None
        self._dirty = True  # the sampler's recent picks are part of its state
        return self.sampler.pick(live_version, self.rng)

    def eval_for(self, domain: str) -> str | None:
        return self.eval_opponent if domain in self.games else None

    def record(self, opponent: str, scores: list[float]) -> None:
        if scores:
            self.sampler.record(opponent, list(scores))
            self._dirty = True

    def poll(self, now: float | None = None) -> None:
        """Once a second: new snapshots to the sampler, unwanted ones deleted, the state saved if it changed."""
        now = time.monotonic() if now is None else now
        if now < self._next_scan:
            return
        self._next_scan = now + 1.0
        self.scan()
        if self._dirty:
            self.save()

    def scan(self) -> None:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return
        found = sorted(int(m.group(1)) for n in names if (m := _SNAPSHOT.fullmatch(n)))
        for v in found:
            if v not in self.known:
                self.known.add(v)
                if self.sampler.keep(v):
                    self.sampler.add(v)
                    self._dirty = True
                    log.info("self-play: snapshot of version %d joins the opponents (%s)", v, _summary(self.sampler))
        wanted = set(self.sampler.snapshots())
        newest = max(found, default=-1)
        now = time.monotonic()
        for v in found:  # the newest stays: the sampler may take it next
            if v in wanted or v == newest:
                self._unwanted.pop(v, None)
            elif now - self._unwanted.setdefault(v, now) >= DELETE_AFTER_S:
                # a group picked against it just before it left the pool has had time to load it
                (self.folder / snapshot_name(v)).unlink(missing_ok=True)
                self.known.discard(v)
                self._unwanted.pop(v, None)

    def save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.sampler.state()))
        os.replace(tmp, self.state_path)
        self._dirty = False

    def metrics(self) -> dict[str, float]:
        return dict(self.sampler.metrics())

    def close(self) -> None:
        self.scan()
        self.save()


def _summary(sampler: Any) -> str:
    m = sampler.metrics()
    return ", ".join(f"{k.removeprefix('selfplay/')} {v:.3g}" for k, v in m.items()
                     if k in ("selfplay/pool_size", "selfplay/rating/live", "selfplay/win_rate/vs_pool")) or "empty"


__all__ = ["SNAPSHOTS", "STATE", "SelfPlay", "roles_of", "snapshot_every"]
