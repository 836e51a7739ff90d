"""The learner's loop: the four seams joined, top to bottom.

    source (BatchSource) -> trainer (Trainer.step) -> checkpointer (Checkpointer) -> publisher (Publisher)

Each step, on every rank: this rank's share of a batch from the source, one optimizer step on it (the
policy version goes up by one), a checkpoint when due (the batches it records are then acknowledged to
the source), the weights published every `weights.every` steps, and the step's metrics reported (off the
step when there is a background thread). The pieces live on `Learner` (learner.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.learner.learner import Learner

log = logging.getLogger("tidal.learner")


def run(learner: Learner) -> int:
    """Train until `max_steps`, a stop request or the end of the source, then checkpoint, acknowledge,
    export and close."""
    cfg = learner.cfg
    if learner.version > 0 and cfg.weights.every:
        # resumed from a checkpoint: the generators (started over, or resumed with the run) get its
        # weights now, not after the next step (which waits for samples made with them)
        learner.publish_weights()
    learner.snapshot(first=True)
    try:
        while cfg.max_steps == 0 or learner.step < cfg.max_steps:
            if not learner.everyone(not learner.stopped):
                break  # stopped: every rank leaves at the same step (the exit checkpoint is collective)
            if train_one(learner) is None:
                break  # stopped while waiting for a batch, or the source is exhausted
        if cfg.weights.every and learner.step % cfg.weights.every and learner.step == cfg.max_steps:
            # publishing every L steps (lag by design): the last version is published too, so the
            # generators (the run's final evaluation) get the weights the run ends with
            learner.publish_weights()
    except BaseException:
        learner.stop()  # a prefetch still waiting for data gives up within a wait slice: the process exits
        raise
    learner.finish()
    return 0


def train_one(learner: Learner) -> dict[str, float] | None:
    """One step; None when stopped while waiting for the batch (or the source has no more)."""
    cfg = learner.cfg
    t0 = time.perf_counter()
    fetched = learner.fetch(learner.version)
    if not learner.everyone(fetched is not None):
        return None  # a rank was stopped before its batch came: none trains (what came stays unacknowledged)
    assert fetched is not None
    t_batch = time.perf_counter()
    batch, work, asked_at = fetched
    # control-plane latency: from the moment this step could have started (the share complete in the
    # buffer, our request sent, the previous step over: the latest of them) to its start. A batch that
    # waited for a busy learner measures ~0: the learner was not idle for it
    ready_to_step = (time.time() - max(batch.ready_at, asked_at, learner.last_step_end)
                     if batch is not None and batch.ready_at else None)
    batch_id = batch.batch_id if batch is not None else ""
    if learner.sp is not None:
        batch_id, work = learner.sp.share((batch_id, work))
    if cfg.max_steps == 0 or learner.step + 1 < cfg.max_steps:
        learner.prefetch(learner.version + 1)  # the buffer admits the next batch against the version this step makes
    at_version = getattr(learner.trainer, "at_version", None)
    if at_version is not None:  # a trainer that measures lags against the learner's version (KV lag)
        at_version(learner.version)
    metrics = learner.trainer.step(work)
    if metrics.get("train/skipped_nonfinite"):
        ids = [t.id for t in batch.trajectories] if batch is not None else []
        log.warning("step %d skipped: its loss (%g) or gradient norm (%g) is not finite; nothing was updated "
                    "(train/skipped_steps_total counts them). Batch %r, trajectories %s%s", learner.step + 1,
                    metrics.get("loss/total", float("nan")), metrics.get("train/grad_norm", float("nan")),
                    batch_id, ", ".join(ids[:8]), f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")
    if cfg.simulate_s_per_sample:
        time.sleep(cfg.simulate_s_per_sample * int(metrics["train/sequences"]) / learner.dp)
    t_train = time.perf_counter()
    learner.record_step(batch_id, batch, int(metrics["train/sequences"]))
    t_ckpt = time.perf_counter()
    if cfg.weights.every and learner.step % cfg.weights.every == 0:
        learner.publish_weights()
    learner.snapshot()
    t_end = time.perf_counter()
    metrics.update({"train/ack_checkpoint_s": t_ckpt - t_train, "train/publish_s": t_end - t_ckpt})
    timing = {"train/step_s": t_end - t0, "train/wait_batch_s": t_batch - t0, "train/compute_s": t_train - t_batch,
              "train/tokens_per_s": metrics["train/tokens"] / max(t_train - t_batch, 1e-9)}
    learner.report(dict(metrics), timing, ready_to_step, batch.trajectories if batch is not None else [])
    learner.last_step_end = time.time()
    return metrics
