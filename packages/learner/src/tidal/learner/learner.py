"""One learner rank (`Learner`): batches in, a new policy version out.

    source (sources.py: the buffer, or a recording) -> the trainer's step
        -> Checkpointer (checkpoint.py) -> Publisher (publisher.py: weights and metrics)

joined by `loop.run` (loop.py). The model, its optimizer and the step are the caller's (Tidal's own are
`tidal.integration.learner.build`): this package holds what every RL learner of an async loop needs
around them. With checkpoints a batch is acknowledged only once a checkpoint holds it: a learner killed
between two checkpoints resumes from the last one and is served the batches trained since again (exactly
once). Without checkpoints each batch is acknowledged after its step. Rank 0 announces each version
(`WeightsAvailable`, topic ``weights``) and its `Metrics` (topic ``metrics``) on one PUB socket.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from tidal.core.arrays import Array
from tidal.core.errors import ConfigError
from tidal.core.protocol import TOPIC_METRICS, Batch, Metrics
from tidal.learner.checkpoint import Checkpointer, export_hf, write_snapshot
from tidal.learner.config import LearnerConfig
from tidal.learner.metrics import step_metrics
from tidal.learner.publisher import Publisher
from tidal.learner.sources import (
    BatchClientLike,
    BatchRecorder,
    BatchSource,
    BufferSource,
    Fetched,
    FollowerSource,
    Prepare,
    ReplaySource,
)

log = logging.getLogger("tidal.learner")


class Backend(Protocol):
    """The model and its optimizer, as the learner's seams use them."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class Trainer(Protocol):
    """One optimizer step on a batch's work (what `Prepare` made of it); `before_update` is called just
    before the optimizer changes the parameters (the learner waits there for a weight send that still
    reads them)."""

    before_update: Callable[[], None] | None

    def step(self, work: Any) -> dict[str, float]: ...

    # optional: `published(version)`, called after the weights of `version` were handed to the publisher;
    # `at_version(version)`, called before each step with the policy version the step trains from;
    # `state_dict()` / `load_state_dict(state)`: JSON-able state of its own that checkpoints keep (under
    # "trainer" in progress.json, rank 0's, restored on every rank), e.g. an advantage estimator's baselines


class SequenceShare(Protocol):
    """Sequence parallelism as the learner sees it: the SP group's rank 0 (`leader`) gets the batch and
    `share`s it with the others; the group is data-parallel rank `dp_rank` of `dp`."""

    leader: bool
    dp_rank: int
    dp: int

    def share(self, obj: Any) -> Any: ...


Connect = Callable[[int, int, list[str]], BatchClientLike]


class Learner:
    """One learner rank: its four seams (a `BatchSource`, the trainer, a `Checkpointer` and, on rank 0, a
    `Publisher`), the progress counters, and the bookkeeping of trained batches (acknowledged once a
    checkpoint holds them). `loop.run` joins them.

    `backend`: the model and optimizer (`state_dict`, `load_state_dict`, `named_weights`); `trainer`: one
    optimizer step per batch (`step(work) -> metrics`, `before_update`); `prepare(batch, full)`: a
    `Batch` as the trainer takes it. `sp`: sequence parallelism, when the ranks share sequences (its
    `leader`, `dp_rank`, `dp` and `share`). `connect(dp_rank, dp, trained)`: a buffer client (`next_batch`,
    `ack`, `close`: tidal-buffer's `BatchClient`) for `learner.source = "buffer"`."""

    def __init__(self, cfg: LearnerConfig, backend: Backend, trainer: Trainer, prepare: Prepare, *,
                 sp: SequenceShare | None = None, connect: Connect | None = None) -> None:
        self.cfg, self.backend, self.trainer, self.sp = cfg, backend, trainer, sp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # the buffer splits each batch over the data-parallel ranks: one per SP group, whose SP rank 0
        # requests and acknowledges it and hands it to the others
        self.dp_rank, self.dp = (sp.dp_rank, sp.dp) if sp is not None else (self.rank, self.world)
        # Off the step's critical path (one process; with several ranks the gathers and the checkpoint
        # are collective and stay on the step): weights are packed and staged while the next step's
        # forward and backward run (the optimizer waits for it, see `before_update`), and a checkpoint
        # is written from a snapshot while training goes on; the batches it records are acknowledged
        # with the next batch request once it is on disk.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-learner-bg") \
            if self.world == 1 else None
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, backend, every=cfg.checkpoint_every,
                                         keep=cfg.keep_checkpoints, background=self._background)
        self._resume()
        self.source = self._source(prepare, connect)
        # every batch trained, as served, for a later replay (learner.source = "replay")
        self.recorder = BatchRecorder(cfg.record_batches, self.dp_rank) \
            if cfg.record_batches and (sp is None or sp.leader) else None
        self.publisher = Publisher(cfg.publish, cfg.weights, wait_for_subscriber_s=cfg.wait_for_subscriber_s,
                                   security=cfg.security, lora_scale=cfg.lora.scale if cfg.lora else 0.0) \
            if self.rank == 0 else None
        self.last_step_end = 0.0  # time.time() when the previous step ended (the learner free again)
        trainer.before_update = self.wait_published  # the weights in flight are packed first
        self.stopped = False
        if self.rank == 0:
            log.info("learner up at version %d: batches from %s, weights and metrics published on %s",
                     self.version, cfg.source.name if cfg.source.name != "buffer" else cfg.buffer, cfg.publish)

    def _resume(self) -> None:
        """Progress counters, from the checkpoint when there is one."""
        cfg = self.cfg
        self.step = 0
        self.version = 0
        self.samples_trained = 0  # trajectories trained on, over the whole run (kept in checkpoints)
        self.trained_ids: list[str] = []  # with record_trained_ids: every one of them
        # batch ids trained (after a resume, every rank's, as the checkpoint keeps them), and the ones
        # among them not acknowledged yet
        self.trained: deque[str] = deque(maxlen=max(64, 4 * cfg.checkpoint_every * max(1, self.world)))
        self.unacked: list[str] = []
        progress = self.checkpointer.load()
        if progress is not None:
            self.step, self.version = progress["step"], progress["version"]
            self.samples_trained = int(progress.get("samples_trained", 0))
            self.trained_ids = list(progress.get("trained_ids", []))
            self.trained.extend(progress.get("trained", []))
            if "trainer" in progress and hasattr(self.trainer, "load_state_dict"):
                self.trainer.load_state_dict(progress["trainer"])
            log.info("resumed from %s at step %d (version %d)", self.checkpointer.latest, self.step, self.version)

    def _source(self, prepare: Prepare, connect: Connect | None) -> BatchSource:
        """`learner.source`: the buffer (one client per data-parallel share) or a recording; a follower
        for the SP ranks whose group's SP rank 0 asks."""
        cfg = self.cfg
        if self.sp is not None and not self.sp.leader:
            return FollowerSource()
        if cfg.source.name == "replay":
            return ReplaySource(replay_path(cfg), self.dp_rank, self.dp, prepare, done=self.step)
        if cfg.source.name != "buffer" or connect is None:
            known = '"buffer" and "replay"' if connect is not None else '"replay" (no buffer client was given)'
            raise ConfigError(f"learner.source: no batch source {cfg.source.name!r}; the sources are {known} "
                              f"(replay: options = {{ path = \"RECORDING_DIR\" }})", field="learner.source")
        return BufferSource(connect(self.dp_rank, self.dp, list(self.trained)), prepare,
                            timeout_s=cfg.batch_timeout_s, stopped=lambda: self.stopped,
                            prefetch=self.world == 1 and cfg.prefetch)

    def stop(self) -> None:
        self.stopped = True

    def fetch(self, version: int) -> Fetched | None:
        """This rank's share of the next batch (the acknowledgements a finished checkpoint allows go with
        the request)."""
        self.source.ack_later(self.checkpointer.collect(wait=False))
        return self.source.next(version)

    def prefetch(self, version: int) -> None:
        self.source.ack_later(self.checkpointer.collect(wait=False))
        self.source.prefetch(version)

    def record_step(self, batch_id: str, batch: Batch | None, sequences: int) -> None:
        """Count the step trained on `batch_id`, then checkpoint and acknowledge when due."""
        self.step += 1
        self.version += 1
        self.samples_trained += sequences  # all ranks
        self.trained.append(batch_id)
        self.unacked.append(batch_id)
        if self.recorder is not None and batch is not None:
            self.recorder.write(batch)
        if self.cfg.record_trained_ids:  # each data-parallel share once
            self.trained_ids.extend(self.gather_ids([t.id for t in batch.trajectories] if batch is not None else []))
        if self.checkpointer.latest is None or not self.cfg.checkpoint_every:
            # no checkpoint to wait for: the step itself is the record (acknowledged with the next request
            # when one is already on its way, else now)
            ids, self.unacked = self.unacked, []
            if self.source.prefetching:
                self.source.ack_later(ids)
            else:
                self.source.ack_now(ids)
        elif self.checkpointer.due(self.step):
            # in the background: acknowledged with a later request, once written
            self.checkpoint(background=self._background is not None)

    def checkpoint(self, background: bool = False) -> None:
        """Write the checkpoint (collective); the batches it records are acknowledged once it is on disk:
        now (with what an earlier background one recorded), or with a later request."""
        # every rank's (any rank may be served one again), once each (after a resume every rank holds all)
        trained = list(dict.fromkeys(self.gather_ids(list(self.trained))))
        own = self.trainer.state_dict() if hasattr(self.trainer, "state_dict") else {}  # the same on every rank
        progress = {"step": self.step, "version": self.version, "trained": trained,
                    "samples_trained": self.samples_trained,
                    **({"trained_ids": list(self.trained_ids)} if self.cfg.record_trained_ids else {}),
                    **({"trainer": own} if own else {})}
        covers, self.unacked = self.unacked, []
        ready = self.checkpointer.save(progress, covers, background)
        if background:
            self.source.ack_later(ready)
        else:
            self.source.ack_now(ready)

    def report(self, metrics: dict[str, float], timing: dict[str, float], ready_to_step: float | None,
               trajectories: list[Any]) -> None:
        """Rank 0 publishes and logs the step's metrics: off the step when there is a background thread
        (it runs while the next step's backward frees the GIL)."""
        if self.publisher is None:
            return
        counters = (self.step, self.version, self.samples_trained)  # as they are after this step
        if self._background is not None:
            self._background.submit(self._report, metrics, timing, ready_to_step, trajectories,
                                    *counters).add_done_callback(_log_failure)
        else:
            self._report(metrics, timing, ready_to_step, trajectories, *counters)

    def _report(self, metrics: dict[str, float], timing: dict[str, float], ready_to_step: float | None,
                trajectories: list[Any], step: int, version: int, samples_total: int) -> None:
        publisher = self.publisher
        assert publisher is not None
        metrics.update(publisher.send_stats)  # of the latest completed send
        metrics["auth/refused"] = float(publisher.auth.refused)  # subscribers without the run's keys
        scalars, lags = step_metrics(metrics, timing, ready_to_step, trajectories, version, samples_total)
        publisher.publish(TOPIC_METRICS, Metrics(
            source=f"learner-{self.rank}", step=version, time=time.time(), scalars=scalars,
            histograms={"lag": Array.from_numpy(lags.astype(np.float32))}))
        log.info("step %d  version %d  loss %.4f  reward %.3f  tokens/s %.0f", step, version,
                 scalars.get("loss/total", 0.0), scalars["reward/mean"], scalars["train/tokens_per_s"])

    def publish_weights(self) -> None:
        weights = self.backend.named_weights()  # every rank iterates: FSDP2 gathers are collective
        if self.publisher is None or self.publisher.sender is None:
            for _ in weights:
                pass
            return
        self.publisher.send_weights(weights, self.version, self._background)
        published = getattr(self.trainer, "published", None)
        if published is not None:  # a trainer that anchors to the weights it published (lag_logprobs)
            published(self.version)

    def snapshot(self, first: bool = False) -> None:
        """Self-play: the frozen snapshot of this version when `snapshot_every` asks for one (collective).
        `first`: the start of the loop, which writes version 0 (the starting policy, the pool's first
        opponent) on a fresh start and nothing on a resume (its version was written before)."""
        every, folder = self.cfg.snapshot_every, self.cfg.snapshot_dir
        if not every or not folder or (first and self.version > 0) or self.version % every:
            return
        t0 = time.perf_counter()
        path = write_snapshot(folder, self.backend, self.version)
        if path is not None:
            log.info("snapshot of version %d written to %s (%.0f ms)", self.version, path,
                     (time.perf_counter() - t0) * 1e3)

    def wait_published(self) -> None:
        """Block until the weights being sent in the background are packed and announced (before the
        optimizer changes them); raises what the send raised."""
        if self.publisher is not None:
            self.publisher.wait()

    def finish(self) -> None:
        """The end of training: the last weights sent, the exit checkpoint, the last acknowledgements, the
        export, everything closed."""
        self.wait_published()
        if self.checkpointer.latest is not None:
            self.checkpoint()
        # stopped with the ack unconfirmed (the buffer may be stopping too): the checkpoint records them as
        # trained, and a batch the buffer serves again is acknowledged without training
        ids, self.unacked = self.checkpointer.collect(wait=True) + self.unacked, []
        self.source.ack_now(ids)
        if self.cfg.export_dir:
            self.export()
        self.close()

    def export(self) -> None:
        """The policy as a Hugging Face folder at `export_dir` (collective: every rank gathers, rank 0
        writes)."""
        t0 = time.perf_counter()
        out = export_hf(self.cfg.export_dir, self.backend, self.cfg.model)
        if out is not None:
            log.info("policy at version %d written to %s (%.1f s)", self.version, out, time.perf_counter() - t0)

    def everyone(self, flag: bool) -> bool:
        """True when `flag` holds on every rank (a collective: every rank calls it at the same point)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.cfg.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def gather_ids(self, ids: list[str]) -> list[str]:
        if self.world == 1:
            return ids
        every: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(every, ids)
        return [i for part in every for i in (part or [])]

    def close(self) -> None:
        self.wait_published()
        if self._background is not None:
            self._background.shutdown(wait=True)
        self.source.close()
        if self.recorder is not None:
            self.recorder.close()
        if self.publisher is not None:
            self.publisher.close(finished=not self.stopped)


def replay_path(cfg: LearnerConfig) -> str:
    path = cfg.source.options.get("path")
    if not isinstance(path, str) or not path or set(cfg.source.options) != {"path"}:
        raise ConfigError(f"learner.source: \"replay\" takes one option, path (the folder a learner recorded "
                          f"with learner.record_batches), got {dict(cfg.source.options)}", field="learner.source")
    return path


def _log_failure(fut: Future) -> None:
    """A background report that raised: logged (a metrics row lost), never fatal to training."""
    e = fut.exception()
    if e is not None:
        log.error("reporting a step's metrics failed: %r", e)


