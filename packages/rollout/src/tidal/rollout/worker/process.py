"""The rollout worker process: assignments in, scored trajectories out, weights applied in flight.

    python -m tidal.rollout.worker.process --config rollout.toml name=rollout-1 engine.options.max_num_seqs=32

Talks to three peers, all through tidal.core channels:

- the **controller** (DEALER -> its ROUTER): the worker says Hello, then asks for work with
  `WorkRequest(want=n)` (credit-based: it never holds more groups than `max_groups`), receives
  `Assignment`s, reports each group with `Ack(kind=ACK_ASSIGNMENT)` once the buffer has acknowledged every
  sample (``ok=False`` with the reason when a group was dropped; ``left_out`` = the samples of its failed episodes when it
  trained on its survivors), and sends `Heartbeat` and `Metrics`.
  A `Heartbeat` also goes out the moment new weights are applied: the controller's depth gate opens on
  it, so the version report never waits for the heartbeat period (that is for liveness only).
  `Control(command="stop")` ends it after in-flight trajectories are delivered. A `WeightsAvailable`
  may arrive here too.
- the **buffer** (PUSH to its ingest, SUB to its ack topic): each finished group travels as one
  `TrajectoryGroup` (acknowledged under the group id) of `Trajectory`s whose ids are
  ``<group_id>:<sample_index>``, resent until acknowledged; the buffer deduplicates by trajectory id,
  so a resend, or a regeneration by a restarted worker, never trains twice.
- the **weights publisher** (SUB, optional): `WeightsAvailable` announcements, applied through the
  engine's `receive_weights` (transport found by name in the plugin registry) on a thread of their
  own, so generation goes on while bytes move; only the newest announcement is applied.

Every sample of a group is generated with a seed derived from the group id and sample index, so a
regenerated sample under the same weights is the same sample.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from tidal.core.channels import Waker, dealer, make_hello, poll, sub
from tidal.core.config import load_config
from tidal.core.episodes import is_episodic
from tidal.core.errors import ChannelTimeout, ProtocolError
from tidal.core.interfaces import GenerationResult, Task
from tidal.core.net import on_this_node
from tidal.core.plugins import registry
from tidal.core.process import role_main, setup_role_process
from tidal.core.protocol import (
    ACK_ASSIGNMENT,
    BASELINE_KEY,
    Ack,
    Assignment,
    Control,
    Error,
    Heartbeat,
    Hello,
    Metrics,
    Trajectory,
    TrajectoryGroup,
    WeightsAvailable,
    WorkRequest,
    group_of,
    trajectory_id,
)
from tidal.core.reliable import AckedPusher
from tidal.rollout.engines.common import submit_all, warm_up
from tidal.rollout.episodes.multiturn import EpisodeFailed, MultiTurn, start_multiturn
from tidal.rollout.episodes.process import register_plugins
from tidal.rollout.tiny import load_tokenizer
from tidal.rollout.worker.applier import WeightApplier
from tidal.rollout.worker.config import WorkerConfig
from tidal.rollout.worker.results import ResultForwarder, iter_requests, trajectory_of
from tidal.rollout.worker.scoring import ConcurrentScoring, Domains, SampleError
from tidal.rollout.worker.transcripts import TranscriptWriter, episode_record

log = logging.getLogger("tidal.rollout.worker")

EVAL_KEY = "tidal.eval"  # Assignment.metadata key of held-out evaluation groups (value: the eval round)


def _software() -> dict[str, str]:
    out = {}
    for dist in ("tidal-core", "tidal-rollout"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


@dataclass
class _Group:
    assignment: Assignment
    task: Task
    results: dict[int, GenerationResult] = field(default_factory=dict)
    unacked: set[str] = field(default_factory=set)
    sent: bool = False
    started: float = field(default_factory=time.monotonic)
    eval: bool = False  # an evaluation group: scored trajectories go back to the controller, not the buffer
    episodic: bool = False  # multi-turn: its samples are episodes run by `RolloutWorker.multiturn`
    left_out: list[str] = field(default_factory=list)  # why each failed episode was left out (survivors)
    scores: list[float] = field(default_factory=list)  # self-play: the live seat's reward per episode (Ack.scores)
    samples_left_out: int = 0  # granted samples not delivered: failed episodes' seats, game seats that never moved


class RolloutWorker:
    def __init__(self, cfg: WorkerConfig, engine: Any | None = None) -> None:
        self.cfg = cfg
        if engine is None:
            if not cfg.model:
                raise ValueError("the rollout worker needs `model` (a local Hugging Face folder)")
            options = {"weight_transport_options": cfg.receiver_options(), **cfg.engine.options}
            engine = registry.build("engine", cfg.engine.name, options, cfg.model, field="engine")
        self.engine = engine
        if cfg.episodes.plugins:  # local plugin modules: this process builds their envs too (is it episodic?)
            register_plugins(cfg.episodes.plugins)
        self.tokenizer = load_tokenizer(cfg.model) if cfg.model else None
        self.domains = Domains(cfg, self.tokenizer)
        self.dropped_by_reason: dict[str, int] = {}
        self.protocol_errors: dict[str, int] = {}  # bad messages dropped, by ProtocolError.reason
        self._logged_kinds: set[tuple[str, str]] = set()  # (reason, exception type) already logged with traceback
        self.groups: dict[str, _Group] = {}
        self.by_request: dict[str, tuple[str, int]] = {}
        sec = cfg.security  # with a run's keys: every channel CURVE, each server authenticated by its key
        buffer_curve = sec.client("buffer")
        self.pusher = AckedPusher(cfg.buffer_ingest, cfg.buffer_acks, cfg.name, window=max(64, cfg.max_groups * 64),
                                  resend_after=cfg.resend_after_s, on_ack=self._on_ack,
                                  curve_push=buffer_curve, curve_ack=buffer_curve)
        self.ctl = dealer(cfg.controller, identity=cfg.name.encode(), linger=1.0, curve=sec.client("driver"))
        # only the learner's key (or its node's relay's) can announce weights here
        self.wsub = sub(on_this_node(cfg.weights), topics=[cfg.weights_topic], linger=0, curve=sec.client(cfg.weights_server)) \
            if cfg.weights else None
        self._requested = 0  # assignments asked for and not yet received
        # when each of them was asked for (oldest first), and the window's request -> assignment times: the
        # control plane's round trip while the depth gate is open, plus the gate's wait while it is shut
        self._asked_at: deque[float] = deque()
        self._credit_rtt: list[float] = []
        self._rejections_seen = 0
        self._stop = threading.Event()
        self._stopping = False  # set first: a signal handler's stop() must not re-enter a held Event.set() lock
        # the loop waits on its sockets; finished generations and applied weights wake it at once
        self._waker = Waker()
        self._results = ResultForwarder(self.engine, self._waker)
        self.weights = WeightApplier(self.engine, self._waker, cfg.name)
        self.scoring = ConcurrentScoring(self.domains, self._waker)  # judged domains: scored off the loop
        self.counters = dict.fromkeys(("groups_done", "groups_dropped", "groups_trained_on_survivors", "samples",
                                       "tokens", "reward_sum"), 0.0)
        self._window_start = time.monotonic()
        self._window_tokens = 0.0
        self._window_samples = 0.0
        self._hb_seq = 0
        self._parent_pid = os.getppid()
        self._acked_log = (open(cfg.acked_log.replace("{name}", cfg.name), "a", encoding="utf-8")
                           if cfg.acked_log else None)
        self.multiturn: MultiTurn | None = None  # started with the first episodic group
        self.transcripts = TranscriptWriter(cfg.transcripts, cfg.name)  # what the model wrote, sampled

    # ------------------------------------------------------------------ helpers

    def _send_ctl(self, msg: Any) -> None:
        try:
            self.ctl.send(msg, timeout=5)
        except ChannelTimeout:
            log.warning("controller not reachable; %s not sent", type(msg).__name__)

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        if self.cfg.warmup_samples > 0:
            ms = warm_up(self.engine, self.cfg.warmup_samples, timeout=self.cfg.connect_timeout_s)
            log.info("%s: engine warmed up (%d samples) in %.0f ms", self.cfg.name, self.cfg.warmup_samples, ms)
        if not self._handshake():
            self._shutdown_early()
            return 0
        for d in self.cfg.domains:  # a bad option fails here, once, not on the first sample
            if not is_episodic(self.domains.env(d.key)):  # an episode's outcome is its own verifier's
                self.domains.scorer(d.key)
        self.weights.start()
        self._results.start()
        log.info("%s: engine %s, model %s, up to %d groups", self.cfg.name, self.cfg.engine.name, self.cfg.model,
                 self.cfg.max_groups)
        next_hb = next_metrics = time.monotonic()
        channels = [self.ctl, self.pusher.acks] + ([self.wsub] if self.wsub else [])
        try:
            while not self._stop.is_set():
                self._ask_for_work()
                # Event-driven: sockets, engine results and applied weights wake the wait. Episode
                # environments (their own sockets) and the reliable pusher's resends are polled on a
                # short period.
                wait = 0.005 if self.multiturn is not None else min(0.05, max(0.0, min(next_hb, next_metrics) - time.monotonic()))
                for ch in poll(channels, timeout=wait, waker=self._waker):
                    if ch is not self.pusher.acks:  # acks are processed by pusher.poll below
                        self._on_channel(ch)
                for res in self._results.take():
                    self._on_result(res)
                for gid, outcome in self.scoring.take():
                    self._scored(gid, outcome)
                self._poll_episodes()
                self.pusher.poll(timeout=0)
                self._settle_rejections()
                now = time.monotonic()
                if self.weights.take_applied() or now >= next_hb:
                    self._heartbeat()
                    next_hb = now + self.cfg.heartbeat_interval_s
                if now >= next_metrics:
                    self._metrics()
                    next_metrics = now + self.cfg.metrics_interval_s
        finally:
            self._shutdown()
        return 0

    def _handshake(self) -> bool:
        """Hello to the controller; False when stopped first. Refuses a controller of another protocol
        major version with an error naming both; asks again every 2 s until connect_timeout_s."""
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while True:
            try:
                self.ctl.handshake(make_hello("rollout", self.cfg.name, _software()),
                                   timeout=min(2.0, max(0.01, deadline - time.monotonic())))
                return True
            except ChannelTimeout:
                if self._stop.is_set():
                    return False
                if time.monotonic() >= deadline:
                    raise ChannelTimeout(f"no answer from the controller at {self.cfg.controller} within "
                                         f"{self.cfg.connect_timeout_s:g} s") from None

    def _on_channel(self, ch: Any) -> None:
        """One message from the controller or the weights publisher; a malformed one is dropped, not fatal."""
        try:
            if ch is self.ctl:
                self._on_controller(self.ctl.recv(timeout=0))
            else:
                assert self.wsub is not None  # the other channel polled
                _, msg = self.wsub.recv(timeout=0)
                if isinstance(msg, WeightsAvailable):
                    self.weights.announce(msg)
        except ProtocolError as e:
            self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
            source = "the controller" if ch is self.ctl else "the weights publisher"
            log.error("%s: dropped a bad message from %s: %s", self.cfg.name, source, e)
            # the controller cannot see this otherwise: an assignment it sent just vanished
            self._send_ctl(Error(code="protocol", detail=f"{self.cfg.name} dropped a bad message from {source}: {e}"))

    def _ask_for_work(self) -> None:
        training = sum(1 for g in self.groups.values() if not g.eval)
        want = self.cfg.max_groups - training - self._requested
        if want > 0:
            self._send_ctl(WorkRequest(want=want, version=self.engine.version, running=len(self.groups)))
            self._requested += want
            self._asked_at.extend([time.monotonic()] * want)

    def _on_controller(self, msg: Any) -> None:
        if isinstance(msg, Assignment):
            if EVAL_KEY not in msg.metadata:  # evaluation is sent without credit, on top of training work
                self._requested = max(0, self._requested - 1)
                if self._asked_at:
                    self._credit_rtt.append(time.monotonic() - self._asked_at.popleft())
            self._start_group(msg)
        elif isinstance(msg, WeightsAvailable):
            self.weights.announce(msg)
        elif isinstance(msg, Control):
            if msg.command == "stop":
                log.info("%s: stop requested (%s)", self.cfg.name, msg.reason or "no reason given")
                self.stop()
            elif msg.command == "pause":
                self.engine.pause()
            elif msg.command == "resume":
                self.engine.resume()
        elif isinstance(msg, Hello):
            pass  # the controller's answer to ours
        else:
            log.warning("unexpected %s from the controller", type(msg).__name__)

    def _start_group(self, a: Assignment) -> None:
        if a.group_id in self.groups:
            return  # a repeated assignment of a group in progress
        task = Task(prompt=a.prompt, answer=a.answer, domain=a.domain or a.task, metadata=dict(a.metadata))
        group = _Group(a, task, eval=EVAL_KEY in a.metadata)
        self.groups[a.group_id] = group
        try:
            group.episodic = is_episodic(self.domains.env(a.task))
        except Exception as e:  # a bad env plugin or options: this group is dropped, counted, logged once
            self._drop(group, "env_error", f"environment of domain {a.task!r} could not be built", e)
            return
        if group.episodic and BASELINE_KEY in a.metadata:  # `tidal run`'s check refuses this up front
            self._drop(group, "env_error", f"domain {a.task!r} is multi-turn: its episodes have no greedy baseline "
                       f"member (ReMax's); choose another advantage estimator for it")
            return
        if group.episodic:
            try:
                self._multiturn().start(a, task, roles=tuple(getattr(self.domains.env(a.task), "roles", ())))
            except ValueError as e:  # an opponent this worker cannot seat
                self._drop(group, "env_error", str(e))
            return
        requests = list(iter_requests(a))
        for i, r in enumerate(requests):
            self.by_request[r.request_id] = (a.group_id, i)
        submit_all(self.engine, requests)  # one submission: the group's samples share one prefill

    def _multiturn(self) -> MultiTurn:
        if self.multiturn is None:
            self.multiturn = start_multiturn(self.cfg.name, self.cfg.episodes, self.cfg.domains, self.engine,
                                             self.tokenizer, model=self.cfg.model)
        return self.multiturn

    def _poll_episodes(self) -> None:
        mt = self.multiturn
        if mt is None:
            return
        for reply in mt.pool.poll(timeout=0):
            try:
                gid = mt.on_reply(reply)
            except EpisodeFailed as e:
                self._episode_failed(e)
                continue
            if gid is not None and gid in self.groups:
                self._deliver(self.groups[gid], [])
        for res in mt.poll_snapshots():  # the opponent seats' turns (self-play)
            self._on_result(res)

    def _episode_failed(self, e: EpisodeFailed) -> None:
        """`episodes.on_error` through `MultiTurn.on_failure`: retried, waited out, delivered on the
        survivors, or the group dropped. The Ack's detail is the failure's own text (the author's, for a
        verifier error): the controller quotes the most frequent one when a run cannot train."""
        group = self.groups.get(e.group_id)
        if group is None or self.multiturn is None:
            return
        run = self.multiturn.runs.get(e.episode_id)  # before on_failure takes it out of the pool
        if run is not None and not group.eval and self.transcripts.wants_failure():
            self.transcripts.write(episode_record(run, self.cfg.name, group.assignment.task, e.reason, str(e)))
        what = self.multiturn.on_failure(e)
        if what == "drop":
            self._log_episode_failure(group, e)
            self._drop(group, e.reason, e.cause)
        elif what == "complete":
            self._deliver(group, [])

    def _log_episode_failure(self, group: _Group, e: EpisodeFailed) -> None:
        if (e.reason, "episode") not in self._logged_kinds:  # once per kind; later ones are counted
            self._logged_kinds.add((e.reason, "episode"))
            log.error("%s: group %s of domain %r dropped: %s (%s); later failures of this kind are only counted "
                      "(rollout/episodes/failed/%s, rollout/groups/dropped/%s)", self.cfg.name, group.assignment.group_id,
                      group.assignment.task, e, e.reason, e.reason, e.reason)

    def _on_result(self, res: GenerationResult) -> None:
        if self.multiturn is not None and self.multiturn.owns(res.request_id):
            try:
                self.multiturn.on_result(res)
            except EpisodeFailed as e:
                self._episode_failed(e)
            return
        key = self.by_request.pop(res.request_id, None)
        if key is None:
            return
        gid, index = key
        group = self.groups.get(gid)
        if group is None:
            return
        group.results[index] = res
        if len(group.results) < group.assignment.num_samples:
            return
        if any(r.finish_reason == "abort" for r in group.results.values()):
            self._drop(group, "abort", "a sample was aborted (partial_mode=drop drops groups caught by a weight update)")
            return
        results = [group.results[i] for i in range(group.assignment.num_samples)]
        if self.scoring.concurrent(group.assignment.task):  # a judge: scored off this loop (`_scored` later)
            self.scoring.submit(gid, group.assignment.task, group.task, results)
            return
        outcome: list[float] | SampleError
        try:
            outcome = [self.domains.score(group.assignment.task, group.task, r) for r in results]
        except SampleError as e:
            outcome = e
        self._scored(gid, outcome)

    def _scored(self, gid: str, outcome: list[float] | SampleError) -> None:
        """A group's rewards are in (or its scoring failed: the group is dropped, counted by reason)."""
        group = self.groups.get(gid)
        if group is None:
            return
        if isinstance(outcome, SampleError):
            if not group.eval and self.transcripts.wants_failure():
                self.transcripts.write_single(group.assignment, group.results, self.domains.text, None, outcome.reason,
                                             str(outcome))
            self._drop(group, outcome.reason, str(outcome), outcome.cause)
            return
        self._deliver(group, outcome)

    def _drop(self, group: _Group, reason: str, why: str, cause: BaseException | None = None) -> None:
        gid = group.assignment.group_id
        self.groups.pop(gid, None)
        if group.episodic and self.multiturn is not None:
            self.multiturn.forget(gid)
        self.counters["groups_dropped"] += 1
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + 1
        if cause is not None:
            kind = (reason, type(cause).__name__)
            if kind not in self._logged_kinds:  # the traceback once per kind; later ones are counted
                self._logged_kinds.add(kind)
                log.error("%s: group %s of domain %r dropped (%s); later drops of this kind are only counted",
                          self.cfg.name, gid, group.assignment.task, why, exc_info=cause)
        self._send_ctl(Ack(kind=ACK_ASSIGNMENT, ids=[gid], ok=False, detail=why, reason=reason))

    def _deliver(self, group: _Group, rewards: list[float]) -> None:
        if group.episodic:
            self._deliver_episodes(group)
            return
        a = group.assignment
        if not group.eval and self.transcripts.take_group():
            self.transcripts.write_single(group.assignment, group.results, self.domains.text, rewards)
        members: list[Trajectory] = []
        for i in range(a.num_samples):
            res = group.results[i]
            reward = rewards[i]
            traj = trajectory_of(a, i, res, reward, self.cfg.name)
            if group.eval:
                self._send_ctl(traj)
                continue
            group.unacked.add(traj.id)
            self.counters["samples"] += 1
            self.counters["tokens"] += len(res.completion_ids)
            self.counters["reward_sum"] += reward
            self._window_tokens += len(res.completion_ids)
            members.append(traj)
        if members:  # one message, logged and acknowledged by the buffer as one; settled per sample id
            self.pusher.send(TrajectoryGroup(id=a.group_id, trajectories=members, source=self.cfg.name))
        group.sent = True
        if group.eval:
            del self.groups[a.group_id]

    def _deliver_episodes(self, group: _Group) -> None:
        assert self.multiturn is not None
        gid = group.assignment.group_id
        members = self.multiturn.trajectories(gid, self.cfg.name)
        group.left_out = self.multiturn.left_out(gid)
        group.samples_left_out = self.multiturn.samples_left_out(gid)
        group.scores = self.multiturn.scores(gid)
        if not group.eval:
            self.transcripts.write_episodes(group.assignment, self.multiturn.runs)
        self.multiturn.forget(gid)
        group.sent = True
        if group.eval:  # the episode's last segment carries its outcome
            last = {t.sample_index: t for t in members}
            for t in last.values():
                self._send_ctl(t)
            del self.groups[gid]
            return
        for t in members:
            group.unacked.add(t.id)
            self.counters["samples"] += 1
            self.counters["tokens"] += int(t.loss_mask.numpy().sum()) if t.loss_mask is not None else 0
            self._window_tokens += t.completion_ids.shape[0]
        self.counters["reward_sum"] += sum(t.reward for t in members)
        self.pusher.send(TrajectoryGroup(id=gid, trajectories=members, source=self.cfg.name))

    def _on_ack(self, ids: list[str]) -> None:
        if self._acked_log is not None:  # one write per ack, straight to the OS (a kill -9 keeps it)
            self._acked_log.write("".join(f"{tid}\n" for tid in ids))
            self._acked_log.flush()
        for tid in ids:
            self._settle(tid)

    def _settle_rejections(self) -> None:
        """Trajectories the buffer refused (stale, invalid) are settled too: they are never resent."""
        if len(self.pusher.rejected) > self._rejections_seen:
            for tid in list(self.pusher.rejected)[self._rejections_seen :]:
                log.warning("%s: buffer refused %s: %s", self.cfg.name, tid, self.pusher.rejected[tid])
                self._settle(tid)
            self._rejections_seen = len(self.pusher.rejected)

    def _settle(self, tid: str) -> None:
        gid = group_of(tid)
        group = self.groups.get(gid)
        if group is None:
            return
        group.unacked.discard(tid)
        if group.sent and not group.unacked:
            del self.groups[gid]
            rejected = [t for t in (trajectory_id(gid, i) for i in range(group.assignment.num_samples))
                        if t in self.pusher.rejected]
            self.counters["groups_dropped" if rejected else "groups_done"] += 1
            if rejected:
                self._send_ctl(Ack(kind=ACK_ASSIGNMENT, ids=[gid], ok=False, reason="refused",
                                   detail=f"buffer refused {len(rejected)} of its samples: "
                                          f"{self.pusher.rejected[rejected[0]]}"))
                return
            if group.left_out:
                self.counters["groups_trained_on_survivors"] += 1
            self._send_ctl(Ack(kind=ACK_ASSIGNMENT, ids=[gid], left_out=group.samples_left_out,
                               detail=group.left_out[0] if group.left_out else "", scores=group.scores))

    # ------------------------------------------------------------------ reporting

    def _heartbeat(self) -> None:
        self._hb_seq += 1
        status = {"groups": float(len(self.groups)), "unacked": float(len(self.pusher.pending)),
                  "weights_applied_at": self.weights.applied_at}
        status.update({k: float(v) for k, v in self.engine.load_state().items() if k in ("running", "waiting")})
        self._send_ctl(Heartbeat(role="rollout", name=self.cfg.name, seq=self._hb_seq, time=time.time(),
                                 version=self.engine.version, status=status))

    def _metrics(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._window_start, 1e-9)
        c = self.counters
        scalars = {
            "rollout/tokens_per_s": self._window_tokens / elapsed,
            "rollout/samples_per_s": (c["samples"] - self._window_samples) / elapsed,
            "rollout/samples": c["samples"],
            "rollout/groups/done": c["groups_done"],
            "rollout/groups/dropped": c["groups_dropped"],
            "rollout/groups/trained_on_survivors": c["groups_trained_on_survivors"],
            "rollout/reward_mean": c["reward_sum"] / c["samples"] if c["samples"] else 0.0,
            "rollout/weight_updates": float(self.weights.updates),
            "rollout/weight_update_failures": float(self.weights.failures),
            "rollout/update_pause_ms": 1e3 * float(self.engine.load_state().get("last_update_pause_s", 0.0)),
            "rollout/resent": float(self.pusher.resent),
            **({"rollout/credit_rtt_ms": 1e3 * statistics.median(self._credit_rtt)} if self._credit_rtt else {}),
            **{f"rollout/groups/dropped/{r}": float(n) for r, n in self.dropped_by_reason.items()},
            "rollout/transcripts_written": float(self.transcripts.written),
            **{f"rollout/protocol_errors/{r}": float(n) for r, n in self.protocol_errors.items()},
            **(self.multiturn.metrics() if self.multiturn is not None else {}), **self.scoring.metrics(),
        }
        self._send_ctl(Metrics(source=self.cfg.name, step=self.engine.version, time=time.time(), scalars=scalars))
        self._window_start, self._window_tokens, self._window_samples = now, 0.0, c["samples"]
        self._credit_rtt = []

    def _shutdown_early(self) -> None:
        """Stopped before the controller answered: nothing was generated, close what is open."""
        log.info("%s: stopped before the controller answered", self.cfg.name)
        self._close()

    def _shutdown(self) -> None:
        self.stop()
        self.weights.stop()  # no new version while in-flight trajectories are delivered
        # Started by a driver that is now gone (killed: its death signal brought this stop): every peer is
        # going down at once, so nothing waits for acknowledgements that cannot come.
        orphaned = self._parent_pid != 1 and os.getppid() != self._parent_pid
        if orphaned:
            log.warning("%s: the process that started this worker is gone; stopping without waiting for the "
                        "buffer (%d trajectories unacknowledged)", self.cfg.name, len(self.pusher.pending))
        try:
            self.pusher.flush(timeout=0.0 if orphaned else self.cfg.stop_timeout_s)
        except ChannelTimeout:
            log.warning("%s: %d trajectories still unacknowledged at stop", self.cfg.name, len(self.pusher.pending))
        self.weights.close(timeout=1 if orphaned else 10)
        if not orphaned:
            self._metrics()  # the final counters (the driver keeps the last report of each worker)
        self._close(ctl_linger=0.5)

    def _close(self, ctl_linger: float | None = None) -> None:
        if self.multiturn is not None:
            self.multiturn.pool.close()
            if self.multiturn.snapshots is not None:
                self.multiturn.snapshots.close()
        self._results.close()
        self.scoring.close()
        self.engine.close()
        self.pusher.close()
        self.ctl.close(linger=ctl_linger)
        if self.wsub is not None:
            self.wsub.close()
        if self._acked_log is not None:
            self._acked_log.close()
        self.transcripts.close()
        self._waker.close()

    def stop(self) -> None:
        if not (self._stopping or self._stop.is_set()):  # re-entrant from signal handlers: see _stopping
            self._stopping = True
            self._stop.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tidal-rollout-worker",
        description="Run a Tidal rollout worker: prompt assignments from the controller, generation with the "
                    "configured engine, rewards from the named environment, trajectories to the buffer.",
        epilog="Overrides use dotted TOML syntax, e.g. name=\"rollout-1\" model=\"/models/tiny\" "
               "engine.name=\"vllm\" engine.options.max_num_seqs=32 "
               "domains='[{env={name=\"arithmetic\", options={level=2}}}]'",
    )
    ap.add_argument("--config", help="TOML file with worker settings (defaults otherwise)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default=os.environ.get("TIDAL_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    setup_role_process(args.log_level)  # `kill -USR1 PID` writes every thread's stack to the log
    cfg = load_config(args.config, WorkerConfig, args.overrides)
    worker = RolloutWorker(cfg)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    return worker.run()


if __name__ == "__main__":
    sys.exit(role_main(main, "rollout worker"))
