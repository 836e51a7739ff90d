"""Frozen snapshots of the policy served beside the live one: the opponent seats of self-play episodes.

The learner writes a snapshot of the policy every N versions as ``<snapshot_dir>/v<version>.safetensors``
(`tidal.core.episodes.snapshot_name`); an episode whose opponent is ``v<N>`` generates its opponent seats'
turns with that snapshot. A worker holds each snapshot it plays as an embedded engine of its own (the model
folder's architecture, the snapshot's weights, tagged with the snapshot's version), loaded on first use; past
`held` snapshots, the least recently used one with no turn in flight is closed. The live policy's engine is
not touched: its weight updates and its batches never wait for an opponent's.

With vLLM as the live engine the snapshots still run here, in the embedded engine (on the worker's CPU or
its device): a second vLLM engine per snapshot would hold a whole KV cache pool each. Serving snapshots as
LoRA adapters of one vLLM engine would fit a LoRA run only; not done.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.core.episodes import snapshot_name
from tidal.core.interfaces import GenerationRequest, GenerationResult

log = logging.getLogger("tidal.rollout.opponents")


class OpponentUnavailable(RuntimeError):
    """The snapshot an episode's opponent names cannot be served (its file is missing or unreadable)."""


class SnapshotEngines:
    """Engines of frozen policy versions, keyed by version (module docstring)."""

    def __init__(self, folder: str | Path, model: str | Path, held: int = 4, tokenizer: Any = None,
                 max_num_seqs: int = 64, device: str = "cpu") -> None:
        if held < 1:
            raise ValueError(f"rollout.episodes.snapshots_held must be >= 1, got {held}")
        self.folder, self.model, self.held = Path(folder), model, held
        self.tokenizer, self.max_num_seqs, self.device = tokenizer, max_num_seqs, device
        self.engines: OrderedDict[int, Any] = OrderedDict()  # version -> engine, least recently used first
        self.inflight: dict[str, int] = {}  # request id -> the version generating it
        self.counters: dict[str, float] = {"loads": 0.0, "load_s": 0.0, "evictions": 0.0, "turns": 0.0}

    def path(self, version: int) -> Path:
        return self.folder / snapshot_name(version)

    def engine(self, version: int) -> Any:
        """The engine of `version`, loaded now if it is not held (OpponentUnavailable when it cannot be)."""
        if version in self.engines:
            self.engines.move_to_end(version)
            self._evict(keep=version)  # one kept past `held` while it was busy may go now
            return self.engines[version]
        path = self.path(version)
        if not path.is_file():
            raise OpponentUnavailable(f"no snapshot of version {version} at {path} (never written, or pruned "
                                      f"from the pool)")
        t0 = time.perf_counter()
        # heavy: torch and the engine; a worker that plays no snapshot never imports them here
        from safetensors.torch import load_file

        from tidal.rollout.engines.embedded import EmbeddedEngine

        try:
            weights = load_file(str(path))
        except Exception as e:  # a truncated or foreign file: this opponent cannot be played
            raise OpponentUnavailable(f"snapshot {path} is unreadable: {type(e).__name__}: {e}") from None
        engine = EmbeddedEngine(self.model, device=self.device, max_num_seqs=self.max_num_seqs, version=-1,
                                tokenizer=self.tokenizer)
        try:
            engine.update_weights(list(weights.items()), version)
        except Exception as e:
            engine.close()
            raise OpponentUnavailable(f"snapshot {path} does not fit the model {self.model}: {e}") from None
        self.engines[version] = engine
        self.counters["loads"] += 1
        self.counters["load_s"] += time.perf_counter() - t0
        log.info("opponent snapshot of version %d loaded from %s in %.0f ms (%d held)", version, path,
                 (time.perf_counter() - t0) * 1e3, len(self.engines))
        self._evict(keep=version)
        return engine

    def _evict(self, keep: int) -> None:
        """Close the least recently used engines past `held`, never `keep` (about to be used) nor one with
        a turn in flight (then more than `held` stay until those turns end)."""
        busy = {*self.inflight.values(), keep}
        for version in list(self.engines):
            if len(self.engines) <= self.held:
                return
            if version not in busy:
                self.engines.pop(version).close()
                self.counters["evictions"] += 1

    def submit(self, version: int, request: GenerationRequest) -> None:
        self.engine(version).submit(request)
        self.inflight[request.request_id] = version
        self.counters["turns"] += 1

    def poll(self) -> list[GenerationResult]:
        out: list[GenerationResult] = []
        for engine in list(self.engines.values()):
            for res in engine.poll(timeout=0):
                self.inflight.pop(res.request_id, None)
                out.append(res)
        return out

    def abort(self, request_ids: Sequence[str]) -> None:
        by_version: dict[int, list[str]] = {}
        for rid in request_ids:
            v = self.inflight.pop(rid, None)
            if v is not None:
                by_version.setdefault(v, []).append(rid)
        for v, rids in by_version.items():
            if v in self.engines:
                self.engines[v].abort(rids)

    def metrics(self) -> dict[str, float]:
        return {**{f"rollout/opponents/{k}": v for k, v in self.counters.items()},
                "rollout/opponents/held": float(len(self.engines))}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


__all__ = ["OpponentUnavailable", "SnapshotEngines"]
