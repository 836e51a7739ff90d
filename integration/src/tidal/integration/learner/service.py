"""The learner process: batches from the buffer in, a new policy version out.

    python -m tidal.integration.learner --config learner.toml model="/models/tiny" backend.name="fsdp2" --nproc 2

Each step, on every rank: request this rank's share of a batch from the buffer, train on it
(`Trainer.step`), bump the policy version, checkpoint when due and then acknowledge the batches that
checkpoint records as trained, and every `weights.every` steps publish the full weights through the
configured tidal-weight-sync transport (found by name in the plugin registry; FSDP2 weights are gathered
one tensor at a time on every rank, rank 0 sends). Rank 0 announces each version (`WeightsAvailable`,
topic ``weights``) and its `Metrics` (topic ``metrics``) on one PUB socket.

With checkpoints a batch is acknowledged only once a checkpoint holds it: a learner killed between two
checkpoints resumes from the last one and is served the batches trained since again (exactly once).
Without checkpoints each batch is acknowledged after its step.

`--nproc N` starts N ranks under torch.distributed (gloo on CPU, NCCL on GPU) on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from tidal.buffer.client import BatchClient
from tidal.core.arrays import Array
from tidal.core.config import load_config
from tidal.core.errors import ChannelTimeout
from tidal.core.plugins import registry
from tidal.core.process import role_main, setup_role_process
from tidal.core.protocol import NO_VERSION, TOPIC_METRICS, Metrics
from tidal.integration.learner.backends import has_sinks, pick_attention
from tidal.integration.learner.checkpoint import (
    export_hf,
    keep_last,
    load_checkpoint,
    save_checkpoint,
    snapshot,
)
from tidal.integration.learner.config import BackendConfig, LearnerConfig
from tidal.integration.learner.data import Sample
from tidal.integration.learner.parallel import (
    ParallelConfig,
    check_parallel,
    ep_backend_options,
    model_config,
    setup_sequence_parallel,
)
from tidal.integration.learner.publisher import Publisher
from tidal.integration.learner.trainer import Prepared, Trainer, needs_critic, needs_reference

log = logging.getLogger("tidal.learner")


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        if not cfg.model:
            raise ValueError("the learner needs `model` (a local Hugging Face folder)")
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        options = self._build_backend()
        reference = _load_reference(cfg, options.attn) if needs_reference(cfg.train) else None
        self.trainer = Trainer(self.backend, cfg.train, reference, routing_replay=cfg.moe.replay, sp=self.sp)
        self._resume()
        self._connect()
        # Off the step's critical path (one process; with several ranks the gathers and the checkpoint
        # are collective and stay on the step): weights are packed and staged while the next step's
        # forward and backward run (the optimizer waits for it, see Trainer.before_update), and a
        # checkpoint is written from a snapshot while training goes on; the batches it records are
        # acknowledged with the next batch request once it is on disk.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-learner-bg") \
            if self.world == 1 else None
        # the buffer client's own thread when prefetching (a ZeroMQ socket is used by one thread only):
        # every request and ack of this learner goes through it, in order
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-learner-fetch") \
            if self.world == 1 and cfg.prefetch and self.client is not None else None
        self._prefetched: Future | None = None
        self._last_step_end = 0.0  # time.time() when the previous step ended (the learner free again)
        self._checkpointing: Future | None = None
        self._ack_next: list[str] = []  # checkpointed batches, acknowledged with the next request
        self._checkpoint_covers: list[str] = []  # the batches the background checkpoint records
        self.trainer.before_update = self.wait_published  # the weights in flight are packed first
        self._stop = False
        if self.rank == 0:
            log.info("learner up at version %d: batches from %s, weights and metrics published on %s",
                     self.version, cfg.buffer, cfg.publish)

    def _build_backend(self) -> BackendConfig:
        """The train backend and sequence parallelism (collective), the parallel layout checked before the
        model is loaded. Returns the backend options used (a value head added for a critic)."""
        cfg = self.cfg
        if cfg.parallel != ParallelConfig():  # refused before the model is loaded
            check_parallel(cfg.parallel, world=self.world, config=model_config(cfg.model), backend=cfg.backend.name,
                           attn=cfg.backend.options.attn)
        torch.manual_seed(cfg.seed)
        options = cfg.backend.options
        if needs_critic(cfg.train) and not options.value_head:
            log.info("advantage %r reads a critic's values (PPO): adding a value head", cfg.train.advantage.name)
            options = msgspec.structs.replace(options, value_head=True)
        # ep: the backend splits MoE experts over a (dp, ep) mesh (checked above by check_parallel)
        self.backend = registry.create("train_backend", cfg.backend.name, cfg.model, options, cfg.device,
                                       **ep_backend_options(cfg.parallel, cfg.backend.name, self.world))
        self.sp = setup_sequence_parallel(cfg.parallel, self.backend)  # collective; None when sp = 1
        # the buffer splits each batch over the data-parallel ranks: one per SP group, whose SP rank 0
        # requests and acknowledges it and hands it to the others
        self.dp_rank, self.dp = (self.sp.dp_rank, self.sp.dp) if self.sp is not None else (self.rank, self.world)
        if self.sp is not None:
            m = self.sp.mesh
            log.info("rank %d: sequence-parallel rank %d of %d (%s: ulysses %d x ring %d), data-parallel share %d of %d",
                     self.rank, m.rank, m.size, cfg.parallel.sp_mode, m.ulysses, m.ring, self.dp_rank, self.dp)
        return options

    def _resume(self) -> None:
        """Progress counters, from <checkpoint_dir>/latest when it holds a checkpoint."""
        cfg = self.cfg
        self.step = 0
        self.version = 0
        self.samples_trained = 0  # trajectories trained on, over the whole run (kept in checkpoints)
        self.trained_ids: list[str] = []  # with record_trained_ids: every one of them
        # batch ids trained (after a resume, every rank's, as the checkpoint keeps them), and the ones
        # among them not acknowledged yet
        self.trained: deque[str] = deque(maxlen=max(64, 4 * cfg.checkpoint_every * max(1, self.world)))
        self.unacked: list[str] = []
        self.latest = Path(cfg.checkpoint_dir) / "latest" if cfg.checkpoint_dir else None
        if self.latest is not None and (self.latest / "progress.json").is_file():
            progress = load_checkpoint(self.latest, self.backend)
            self.step, self.version = progress["step"], progress["version"]
            self.samples_trained = int(progress.get("samples_trained", 0))
            self.trained_ids = list(progress.get("trained_ids", []))
            self.trained.extend(progress.get("trained", []))
            log.info("resumed from %s at step %d (version %d)", self.latest, self.step, self.version)

    def _connect(self) -> None:
        """The buffer client (one per data-parallel share) and, on rank 0, the publisher (metrics and
        weights)."""
        cfg = self.cfg
        self.client = BatchClient(cfg.buffer, self.dp_rank, self.dp, name=f"learner-{self.rank}",
                                  trained=list(self.trained), curve=cfg.security.client("buffer")) \
            if self.sp is None or self.sp.leader else None
        self.publisher = Publisher(cfg.publish, cfg.weights, wait_for_subscriber_s=cfg.wait_for_subscriber_s,
                                   security=cfg.security) \
            if self.rank == 0 else None

    def stop(self) -> None:
        self._stop = True

    def run(self) -> int:
        cfg = self.cfg
        if self.version > 0 and cfg.weights.every:
            # resumed from a checkpoint: the generators (started over, or resumed with the run) get its
            # weights now, not after the next step (which waits for samples made with them)
            self.publish_weights()
        try:
            while cfg.max_steps == 0 or self.step < cfg.max_steps:
                if not self._everyone(not self._stop):
                    break  # stopped: every rank leaves at the same step (the exit checkpoint is collective)
                if self.train_one() is None:
                    break  # stopped while waiting for a batch
        except BaseException:
            self._stop = True  # a prefetch still waiting for data gives up within a wait slice: the process exits
            raise
        self.wait_published()
        if self.latest is not None:
            self.checkpoint()
        self.acknowledge()
        if cfg.export_dir:
            self.export()
        self.close()
        return 0

    def export(self) -> None:
        """The policy as a Hugging Face folder at `export_dir` (collective: every rank gathers, rank 0
        writes)."""
        t0 = time.perf_counter()
        out = export_hf(self.cfg.export_dir, self.backend, self.cfg.model)
        if out is not None:
            log.info("policy at version %d written to %s (%.1f s)", self.version, out, time.perf_counter() - t0)

    def _until_stopped(self, call: Callable[[float], Any], timeout: float, what: str) -> tuple[bool, Any]:
        """`call(slice_timeout)` in slices of at most 2 s until it returns, so that a stop request is seen
        while the buffer is quiet or gone: (True, result), or (False, None) once stopped. ChannelTimeout
        naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return True, call(min(2.0, max(0.01, deadline - time.monotonic())))
            except ChannelTimeout:
                if self._stop:
                    return False, None
                if time.monotonic() >= deadline:
                    raise ChannelTimeout(f"{what} within {timeout:g} s") from None

    def train_one(self) -> dict[str, float] | None:
        """One step; None when stopped while waiting for the batch."""
        t0 = time.perf_counter()
        if self._fetcher is not None:
            fut, self._prefetched = self._prefetched, None
            got, fetched = (fut if fut is not None else self._fetcher.submit(self._fetch, *self._request())).result()
        else:
            got, fetched = self._fetch(*self._request())
        if not self._everyone(got):
            return None  # a rank was stopped before its batch came: none trains (what came stays unacknowledged)
        t_batch = time.perf_counter()
        batch, work, asked_at = fetched
        # control-plane latency: from the moment this step could have started (the share complete in the
        # buffer, our request sent, the previous step over: the latest of them) to its start. A batch that
        # waited for a busy learner measures ~0: the learner was not idle for it
        ready_to_step = (time.time() - max(batch.ready_at, asked_at, self._last_step_end)
                         if batch is not None and batch.ready_at else None)
        batch_id = batch.batch_id if batch is not None else ""
        if self.sp is not None:
            batch_id, work = self.sp.share((batch_id, work))
        if self._fetcher is not None and (self.cfg.max_steps == 0 or self.step + 1 < self.cfg.max_steps):
            # the next batch is trained at the version this step makes: the buffer admits it against that
            self._prefetched = self._fetcher.submit(self._fetch, *self._request(self.version + 1), True)
        metrics = self.trainer.step(work)
        if self.cfg.simulate_s_per_sample:
            time.sleep(self.cfg.simulate_s_per_sample * int(metrics["train/sequences"]) / self.dp)
        t_train = time.perf_counter()
        self._record_step(batch_id, batch, int(metrics["train/sequences"]))
        t_ckpt = time.perf_counter()
        if self.cfg.weights.every and self.step % self.cfg.weights.every == 0:
            self.publish_weights()
        t_end = time.perf_counter()
        metrics.update({"train/ack_checkpoint_s": t_ckpt - t_train, "train/publish_s": t_end - t_ckpt})
        timing = {"train/step_s": t_end - t0, "train/wait_batch_s": t_batch - t0, "train/compute_s": t_train - t_batch,
                  "train/tokens_per_s": metrics["train/tokens"] / max(t_train - t_batch, 1e-9)}
        samples = work.samples if isinstance(work, Prepared) else work
        report = (dict(metrics), timing, ready_to_step, samples, batch.trajectories if batch is not None else [],
                  self.step, self.version, self.samples_trained)
        if self._background is not None:  # off the step: it runs while the next step's backward frees the GIL
            self._background.submit(self._report, *report).add_done_callback(_log_failure)
        else:
            self._report(*report)
        self._last_step_end = time.time()
        return metrics

    def _request(self, version: int | None = None) -> tuple[list[str], int]:
        """(the batches to acknowledge with the next batch request: those a finished checkpoint
        records; the version the batch will be trained at). On the training thread."""
        self._collect_checkpoint(wait=False)
        ack, self._ack_next = self._ack_next, []
        return ack, self.version if version is None else version

    def _fetch(self, ack: list[str], version: int, prepare: bool = False) -> tuple[bool, Any]:
        """This rank's share of the next batch, `ack` acknowledged with the request: (True, (batch,
        samples or `Trainer.prepare`d samples, when asked)), or (False, None) when stopped while waiting;
        batch None on an SP rank that is not its group's 0. On the fetch thread when prefetching."""
        asked_at = time.time()
        if self.client is None:  # under sequence parallelism, SP rank 0 of each group asks
            return True, (None, [], asked_at)
        client = self.client
        got, batch = self._until_stopped(lambda t: client.next_batch(version, timeout=t, ack=ack),
                                         self.cfg.batch_timeout_s, "no batch from the buffer")
        if not got:
            return False, None
        samples = [Sample.from_trajectory(t) for t in batch.trajectories]
        return True, (batch, self.trainer.prepare(samples) if prepare else samples, asked_at)

    def _record_step(self, batch_id: str, batch: Any, sequences: int) -> None:
        """Count the step trained on `batch_id`, then checkpoint and acknowledge when due."""
        self.step += 1
        self.version += 1
        self.samples_trained += sequences  # all ranks
        self.trained.append(batch_id)
        self.unacked.append(batch_id)
        if self.cfg.record_trained_ids:  # each data-parallel share once
            self.trained_ids.extend(self._gather_ids([t.id for t in batch.trajectories] if batch is not None else []))
        if self.latest is None or not self.cfg.checkpoint_every:
            if self._fetcher is not None:  # no checkpoint to wait for: acknowledged with the next request
                self._ack_next.extend(self.unacked)
                self.unacked = []
            else:
                self.acknowledge()  # no checkpoint to wait for: the step itself is the record
        elif self.step % self.cfg.checkpoint_every == 0:
            if self._background is not None:
                self.checkpoint(background=True)  # acknowledged with a later request, once written
            else:
                self.checkpoint()
                self.acknowledge()

    def _report(self, metrics: dict[str, float], timing: dict[str, float], ready_to_step: float | None,
                samples: list[Any], trajectories: list[Any], step: int, version: int, samples_total: int) -> None:
        """Add the send's stats, `timing`, the run's counters (as they were after `step`), staleness and
        rewards to `metrics`; rank 0 publishes and logs them."""
        if self.publisher is not None:
            metrics.update(self.publisher.send_stats)  # of the latest completed send
            metrics["auth/refused"] = float(self.publisher.auth.refused)  # subscribers without the run's keys
        # lag of every sampled token (observation tokens of multi-turn samples have NO_VERSION: no lag)
        lags = (np.concatenate([version - 1 - s.versions[s.versions > NO_VERSION] for s in samples])
                if samples else np.zeros(0))
        metrics.update({
            **timing,
            "train/version": float(version),
            "train/samples_total": float(samples_total),
            "staleness/lag_mean": float(lags.mean()) if len(lags) else 0.0,
            "reward/mean": float(np.mean([s.reward for s in samples])) if samples else 0.0,
        })
        if ready_to_step is not None:
            metrics["train/ready_to_step_ms"] = 1e3 * max(0.0, ready_to_step)
        by_task: dict[str, list[float]] = {}
        for t in trajectories:
            by_task.setdefault(t.task, []).append(float(t.reward))
        if len(by_task) > 1:
            metrics.update({f"reward/{task}": float(np.mean(r)) for task, r in by_task.items()})
        if self.publisher is not None:
            self.publisher.publish(TOPIC_METRICS, Metrics(
                source=f"learner-{self.rank}", step=version, time=time.time(), scalars=metrics,
                histograms={"lag": Array.from_numpy(lags.astype(np.float32))}))
            log.info("step %d  version %d  loss %.4f  reward %.3f  tokens/s %.0f", step, version,
                     metrics.get("loss/total", 0.0), metrics["reward/mean"], metrics["train/tokens_per_s"])

    def acknowledge(self) -> None:
        """Tell the buffer it may forget the batches trained since the last acknowledgement. Stopped with
        the ack unconfirmed (the buffer may be stopping too): the checkpoint records them as trained, and
        a batch the buffer serves again is acknowledged without training."""
        self._collect_checkpoint(wait=True)
        ids, self.unacked, self._ack_next = self._ack_next + self.unacked, [], []
        if not ids or self.client is None:  # an SP rank other than 0: its group's SP rank 0 acknowledges
            return
        client = self.client

        def ack() -> tuple[bool, Any]:
            return self._until_stopped(lambda t: client.ack(ids, timeout=t), 60.0,
                                       f"the buffer did not confirm the ack of {', '.join(ids[:3])}")

        # prefetching: on the client's thread, after the request in flight (stopped, it ends within 2 s)
        acked, _ = self._fetcher.submit(ack).result() if self._fetcher is not None else ack()
        if not acked:
            log.warning("stopping before the buffer confirmed the ack of %d batches (recorded as trained)", len(ids))

    def publish_weights(self) -> None:
        weights = self.backend.named_weights()  # every rank iterates: FSDP2 gathers are collective
        if self.publisher is None or self.publisher.sender is None:
            for _ in weights:
                pass
            return
        self.publisher.send_weights(weights, self.version, self._background)

    def wait_published(self) -> None:
        """Block until the weights being sent in the background are packed and announced (before the
        optimizer changes them); raises what the send raised."""
        if self.publisher is not None:
            self.publisher.wait()

    def checkpoint(self, background: bool = False) -> None:
        """Write the checkpoint (collective). `background`: from a snapshot, on the background thread;
        the batches it records move from `unacked` to the next request's acknowledgements once it is
        on disk (see `_collect_checkpoint`)."""
        assert self.latest is not None
        self._collect_checkpoint(wait=True)  # one writer of <dir>/latest at a time
        # every rank's (any rank may be served one again), once each (after a resume every rank holds all)
        trained = list(dict.fromkeys(self._gather_ids(list(self.trained))))
        progress = {"step": self.step, "version": self.version, "trained": trained,
                    "samples_trained": self.samples_trained,
                    **({"trained_ids": list(self.trained_ids)} if self.cfg.record_trained_ids else {})}
        if not background or self._background is None:
            self._save(progress)
            return
        state, covered, self.unacked = snapshot(self.backend), self.unacked, []
        fut = self._background.submit(self._save, progress, state)
        self._checkpointing, self._checkpoint_covers = fut, covered

    def _save(self, progress: dict[str, Any], state: dict[str, Any] | None = None) -> None:
        """`save_checkpoint` to <checkpoint_dir>/latest, then the newest `keep_checkpoints` kept."""
        assert self.latest is not None
        save_checkpoint(self.latest, self.backend, progress, state)
        keep_last(self.latest.parent, self.latest, progress["step"], self.cfg.keep_checkpoints)

    def _collect_checkpoint(self, wait: bool) -> None:
        """A background checkpoint that finished: its batches are acknowledged with the next request
        (raises what the write raised)."""
        fut = self._checkpointing
        if fut is None or not (wait or fut.done()):
            return
        self._checkpointing = None
        fut.result()
        self._ack_next.extend(self._checkpoint_covers)
        self._checkpoint_covers = []

    def _everyone(self, flag: bool) -> bool:
        """True when `flag` holds on every rank (a collective: every rank calls it at the same point)."""
        if self.world == 1:
            return flag

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.cfg.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _gather_ids(self, ids: list[str]) -> list[str]:
        if self.world == 1:
            return ids

        every: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(every, ids)
        return [i for part in every for i in (part or [])]

    def close(self) -> None:
        self.wait_published()
        if self._background is not None:
            self._background.shutdown(wait=True)
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        if self.client is not None:
            self.client.close()
        if self.publisher is not None:
            self.publisher.close(finished=not self._stop)


def _log_failure(fut: Future) -> None:
    """A background report that raised: logged (a metrics row lost), never fatal to training."""
    e = fut.exception()
    if e is not None:
        log.error("reporting a step's metrics failed: %r", e)


def _load_reference(cfg: LearnerConfig, attn: str) -> Any:
    """The frozen reference model (a KL penalty, distillation): `reference_model`, else the starting one."""
    # heavy: transformers (seconds to import); only loading a model needs it
    from transformers import AutoModelForCausalLM

    ref_path = cfg.reference_model or cfg.model
    reference: Any = AutoModelForCausalLM.from_pretrained(
        ref_path, attn_implementation=pick_attention(attn, torch.device(cfg.device), sinks=has_sinks(ref_path)))
    reference = reference.to(cfg.device)
    reference.requires_grad_(False)
    return reference


def _spawn(nproc: int, argv: list[str]) -> int:
    """`nproc` learner ranks on this machine; the worst exit code. Not torchrun: its agent starts each
    rank in a session of its own, so the driver's kill of the learner's process group (kill -9 drills,
    a stalled run) would leave the ranks running, holding their ports (measured with torch 2.15); and
    a SIGTERM'd agent raises SignalException without the ranks' codes, while the driver needs 0 from a
    clean stop and 78 from a refused configuration. These ranks stay in our process group."""
    # The ranks' rendezvous store listens on loopback alone: a socket bound and listening here, handed to
    # rank 0 (TCPStore on its own listens on every interface). Listening from now on, the port is held.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = str(listener.getsockname()[1])
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env[STORE_FD_ENV] = str(listener.fileno()) if rank == 0 else "-"  # the others connect to it
        fds = (listener.fileno(),) if rank == 0 else ()
        procs.append(subprocess.Popen([sys.executable, "-m", "tidal.integration.learner", *argv], env=env,
                                      pass_fds=fds))
    listener.close()  # rank 0 holds its copy

    def forward(sig, _frame):
        for p in procs:
            p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


STORE_FD_ENV = "TIDAL_STORE_FD"  # rank 0 of a `_spawn`: the listening socket its rendezvous store serves on


def _init_distributed(backend: str) -> None:
    """torch.distributed from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). Ranks started by
    `_spawn` rendezvous through a store whose rank 0 serves on the loopback socket it was handed."""
    fd = os.environ.pop(STORE_FD_ENV, "")
    if fd == "":  # torchrun, Ray: the usual env:// rendezvous
        dist.init_process_group(backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(minutes=10), master_listen_fd=int(fd) if rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tidal-learner",
        description="Run the Tidal learner: batches from the buffer, a policy-gradient step per batch, "
                    "weights published to the generators.",
        epilog="Overrides use dotted TOML syntax, e.g. model=\"/models/tiny\" backend.name=\"fsdp2\" "
               "train.loss.name=\"gspo\" backend.options.optim.lr=1e-6 weights.transport.name=\"shm\"",
    )
    ap.add_argument("--config", help="TOML file with learner settings")
    ap.add_argument("--nproc", type=int, default=1, help="ranks to start on this machine (torch.distributed)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default=os.environ.get("TIDAL_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.nproc > 1 and "RANK" not in os.environ:
        rest = [a for i, a in enumerate(raw) if a != "--nproc" and not a.startswith("--nproc=")
                and not (i > 0 and raw[i - 1] == "--nproc")]
        return _spawn(args.nproc, rest)
    setup_role_process(args.log_level)  # `kill -USR1 PID` writes every thread's stack to the log
    cfg = load_config(args.config, LearnerConfig, args.overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _init_distributed("nccl" if cfg.device.startswith("cuda") else "gloo")
    learner = Learner(cfg)
    signal.signal(signal.SIGTERM, lambda *_: learner.stop())
    signal.signal(signal.SIGINT, lambda *_: learner.stop())
    clean = False
    try:
        code = learner.run()
        clean = code == 0
        return code
    finally:
        if dist.is_initialized():
            if clean:  # every rank done with its last collective before any tears gloo down (a crash at exit otherwise)
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(role_main(main, "learner"))
