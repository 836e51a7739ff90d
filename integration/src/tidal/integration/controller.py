"""The controller: prompts out to rollout workers through the depth gate, held-out evaluation, metrics in.

It owns the run's ROUTER. Rollout workers connect to it, ask for work with `WorkRequest` credits, and
report every group with `Ack(kind="assignment")` once the buffer holds all of its samples. Each grant of
G samples passes the staleness depth gate (tidal-staleness), so no sample is trained on more than
`max_staleness` versions after the policy that generated it (0 in sync mode: lock-step). Training prompts
are drawn from the recipe's domains by weight. Every `eval.every` versions, once every worker holds that
version, the held-out problems of each domain go out as evaluation groups (sent without credit; workers
score them and return the `Trajectory` here instead of to the buffer). The rounds are
`tidal.integration.evaluation.Evaluations`, a base class of the controller kept in its own file.

Groups handed to a worker that dies are handed out again to the others (their samples carry the same ids
and seeds, so the buffer deduplicates whatever the dead worker had already delivered).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tidal.algos.plugin import GREEDY_BASELINE
from tidal.core.arrays import Array
from tidal.core.channels import SubChannel, make_hello, poll, router, sub
from tidal.core.episodes import OPPONENT_KEY, SEAT_KEY
from tidal.core.errors import ChannelTimeout, PeerUnreachable, PluginError, ProtocolError
from tidal.core.plugins import registry
from tidal.core.protocol import (
    ACK_ASSIGNMENT,
    BASELINE_KEY,
    TOPIC_METRICS,
    TOPIC_WEIGHTS,
    Ack,
    Assignment,
    Control,
    Error,
    Heartbeat,
    Metrics,
    SamplingParams,
    Trajectory,
    WeightsAvailable,
    WorkRequest,
    group_id,
)
from tidal.core.security import AuthGuard, ChannelSecurity
from tidal.integration.domains import DomainTasks, check_task, unencodable
from tidal.integration.drops import Drops
from tidal.integration.evaluation import Evaluations
from tidal.integration.recipe import RunConfig, check_env
from tidal.integration.resume import NUMBERING, Numbering, NumberingJournal, ResumePoint
from tidal.integration.selfplay import SelfPlay
from tidal.integration.signal_watch import LearningSignal
from tidal.integration.workers import WorkerState
from tidal.rollout.engines.stops import split_stops
from tidal.rollout.worker.process import EVAL_KEY
from tidal.staleness.depth import DepthGate

log = logging.getLogger("tidal.controller")

MAX_UNENCODABLE = 100  # tasks in a row of one domain the tokenizer cannot encode before the run gives up


class Controller(Evaluations):
    def __init__(self, cfg: RunConfig, *, endpoint: str, learner_pub: str, buffer_pub: str, run_dir: Path,
                 tokenizer, emit: Callable[[Metrics], None], security: ChannelSecurity | None = None,
                 resume: ResumePoint | None = None) -> None:
        self.cfg = cfg
        self.resume = resume
        self.tok = tokenizer
        self.emit = emit
        self._connect(endpoint, learner_pub, buffer_pub, security or ChannelSecurity())
        self.gate = self._depth_gate(run_dir / "depth_gate.json")
        self.rng = random.Random(cfg.seed)
        self._build_domains()
        self._build_sampling(tokenizer)
        sp = cfg.selfplay
        self.selfplay = SelfPlay(sp.opponent, sp.eval_opponent, run_dir, self.domains, cfg.seed) \
            if sp.opponent is not None else None
        self.workers: dict[str, WorkerState] = {}
        self.requeued: deque[Assignment] = deque()  # training work of lost workers (sent for credit)
        self.eval_waiting: deque[Assignment] = deque()  # evaluation work with no live worker (sent without)
        self.eval_attempts: dict[str, int] = {}
        self.last_error: dict[str, str] = {}  # role name -> the latest error it reported, for status
        self.drops = Drops(window_s=cfg.launch.drop_rate_window_s)  # training groups trained or dropped, and why
        self.signal = LearningSignal()  # whether the trained samples carry a learning signal (signal_watch)
        self.tasks_skipped: dict[str, int] = {}  # domain -> tasks whose prompt the tokenizer cannot encode
        # group numbers and tasks drawn, journaled before each assignment leaves: never handed out twice
        self.numbering = NumberingJournal(run_dir / NUMBERING)
        self.next_group = resume.next_group if resume is not None else 0
        self.tasks_drawn: dict[str, int] = {d.name: 0 for d in self.domains}
        if resume is not None:
            self._skip_drawn(resume)
        self.learner_version = resume.version if resume is not None else 0
        self.learner_metrics_version = -1  # newest learner step whose metrics arrived
        self.learner_step_at = 0.0  # its wall clock
        self.learner_up_at = 0.0  # wall clock when the learner's first step (of this run) began
        self.first_step_at = 0.0  # wall clock when it ended: the run's first trained samples
        self._trained: deque[tuple[float, float]] = deque(maxlen=512)  # (wall clock, samples trained) per step
        self._init_evals(run_dir)
        self.last: dict[str, dict[str, float]] = {}  # latest scalars by source
        self.counts = {"groups_granted": 0, "groups_done": 0, "groups_dropped": 0, "groups_requeued": 0}
        # control-plane latency: from the last worker applying a version to the first grant it unlocked
        self._opened_at: float | None = None  # applied_at of the version that last opened the gate
        self.apply_to_grant_s: deque[float] = deque(maxlen=200)
        # the control plane under load (tools/bench/control_plane.py): messages taken from the workers; the
        # time from the learner announcing a version to every live worker holding it; how old a worker's
        # heartbeat is when this loop takes it (the controller's backlog)
        self.messages_in = 0
        self._announced_at: dict[int, float] = {}  # version -> wall clock its announcement arrived
        self.version_to_all_s: deque[float] = deque(maxlen=200)
        self.heartbeat_age_s: deque[float] = deque(maxlen=1000)
        self.started = time.monotonic()

    def _connect(self, endpoint: str, learner_pub: str, buffer_pub: str, sec: ChannelSecurity) -> None:
        # with the run's keys: only its rollout workers get in (refusals counted: auth/refused), and the
        # subscriptions trust only the learner's and the buffer's keys
        self.auth = AuthGuard()
        self.ch = router(endpoint, hello=make_hello("controller", "controller"), linger=0,
                         curve=sec.server(["rollout"], self.auth, "controller"))
        self.learner_sub = sub(learner_pub, topics=[TOPIC_METRICS, TOPIC_WEIGHTS], linger=0, curve=sec.client("learner"))
        self.buffer_sub = sub(buffer_pub, topics=[TOPIC_METRICS], linger=0, curve=sec.client("buffer"))
        self.protocol_errors: dict[str, int] = {}  # malformed messages dropped, by ProtocolError.reason

    def _depth_gate(self, gate_path: Path) -> DepthGate:
        cfg, resume = self.cfg, self.resume
        staleness = 0 if cfg.mode == "sync" else cfg.max_staleness
        if resume is not None:  # rebuilt from the buffer's WAL and the checkpoint, never a dead run's counters
            old = _old_gate(gate_path)
            gate_path.unlink(missing_ok=True)
        gate = DepthGate(staleness, cfg.batch_samples, state_path=gate_path)
        if resume is not None:
            gate.load_state_dict(resume.gate_state(old.get("granted", 0), old.get("rejected", 0)))
            if old:
                log.info("depth gate rebuilt: %s (the interrupted run's file said in_flight=%s accepted=%s)",
                         gate, old.get("in_flight"), old.get("accepted"))
        return gate

    def _build_domains(self) -> None:
        cfg = self.cfg
        self.domains = [DomainTasks(d.key, d.env.name,
                                    registry.build("env", d.env.name, d.env.options, field=f"domains[{i}].env"),
                                    d.weight, cfg.seed + i, cfg.eval.size if cfg.eval.every else 0, f"domains[{i}]")
                        for i, d in enumerate(cfg.domains)]
        for i, dom in enumerate(self.domains):  # done by the pre-flight already, unless launch.check_envs = false
            check_env(cfg, i, dom.env)
        for i, d in enumerate(cfg.domains):  # a reward plugin's options fail here, before any worker starts
            if d.reward is not None:
                registry.build("reward", d.reward.name, d.reward.options, field=f"domains[{i}].reward")
        self.weights = np.array([d.weight for d in self.domains], float) / sum(d.weight for d in self.domains)

    def _build_sampling(self, tokenizer) -> None:
        cfg = self.cfg
        stop_ids, stop_strings = split_stops(tokenizer, cfg.sampling.stop)
        s = cfg.sampling
        self.train_sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                             max_tokens=s.max_tokens, stop_token_ids=stop_ids, stop=stop_strings,
                                             return_sampling_mask=s.return_sampling_mask,
                                             return_routing=s.return_routing)
        self.eval_sampling = SamplingParams(temperature=cfg.eval.temperature, max_tokens=cfg.eval.max_tokens or s.max_tokens,
                                            stop_token_ids=stop_ids, stop=stop_strings, seed=cfg.seed)

    # ------------------------------------------------------------------ the loop

    def step(self, timeout: float = 0.05) -> None:
        """Handle what arrived within `timeout`, then hand out what the gate allows."""
        self._take(poll([self.ch, self.learner_sub, self.buffer_sub], timeout=timeout))
        self._advance_version()
        if self.selfplay is not None:
            self.selfplay.poll()
        self._dispatch()
        self._finish_evals()

    def drain(self, timeout: float) -> None:
        """Read what the workers and the learner sent before they stopped (their last metrics: a learner
        stopped mid-step still finishes and reports it), handing out nothing."""
        deadline = time.monotonic() + timeout
        while ready := poll([self.ch, self.learner_sub, self.buffer_sub], timeout=max(0.0, deadline - time.monotonic())):
            self._take(ready)
            if time.monotonic() >= deadline:
                return

    def _take(self, ready: list) -> None:
        """Handle what waits on the `ready` channels: workers' messages and the learner's and buffer's."""
        for ch in ready:
            for _ in range(256):  # drain, bounded so one busy peer cannot starve the rest
                try:
                    if ch is self.ch:
                        peer, msg = self.ch.recv(timeout=0)
                        self.messages_in += 1
                        self._on_worker(peer, msg)
                    else:
                        assert isinstance(ch, SubChannel)  # the learner's or the buffer's PUB
                        topic, msg = ch.recv(timeout=0)
                        self._on_published(topic, msg)
                except ChannelTimeout:
                    break
                except ProtocolError as e:
                    self._protocol_error(e)

    def _protocol_error(self, e: ProtocolError) -> None:
        """A message no decoder could accept (of any kind: the codec turns every failure into this one):
        counted by reason, logged, and the loop goes on."""
        self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
        log.error("dropped a malformed message from %r: %s", e.peer, e)

    def _on_worker(self, peer: bytes, msg) -> None:
        hello = self.ch.peers.get(peer)
        name = hello.name if hello is not None else peer.decode(errors="replace")
        w = self.workers.get(name)
        if w is None or w.peer != peer:
            w = self.workers[name] = WorkerState(name=name, peer=peer,
                                                 outstanding=w.outstanding if w is not None else {})
            log.info("worker %s connected", name)
        w.last_seen = time.monotonic()
        w.alive = True
        if isinstance(msg, WorkRequest):
            w.credits += msg.want
            w.version = msg.version  # what this process holds (a restarted one starts over)
        elif isinstance(msg, Heartbeat):  # also sent the moment a worker applies new weights
            self.heartbeat_age_s.append(max(0.0, time.time() - msg.time))
            if msg.version > w.version:
                w.applied_at = msg.status.get("weights_applied_at", 0.0)
            w.version = msg.version
        elif isinstance(msg, Ack) and msg.kind == ACK_ASSIGNMENT:
            for gid in msg.ids:
                a = w.outstanding.pop(gid, None)
                if a is None:
                    continue
                if not msg.ok and msg.reason != "abort":
                    self.last_error[name] = f"group {gid}: {msg.detail}"
                if EVAL_KEY in a.metadata:
                    if not msg.ok:
                        self._eval_failed(a, msg)
                    continue
                self._settled(gid, name, a, msg)
        elif isinstance(msg, Trajectory) and msg.group_id in w.outstanding:
            a = w.outstanding.pop(msg.group_id)
            rnd = self.evals.get(int(a.metadata[EVAL_KEY]))
            if rnd is not None:
                rnd.rewards[msg.group_id] = msg.reward
                rnd.versions.extend(int(v) for v in msg.versions.numpy())
        elif isinstance(msg, Metrics):
            self._record(msg)
        elif isinstance(msg, Error):  # e.g. an assignment the worker could not decode
            self.last_error[name] = msg.detail
            log.error("%s reported: %s", name, msg.detail)

    def _settled(self, gid: str, worker: str, a: Assignment, msg: Ack) -> None:
        """A training group came back: its delivered samples count for the gate, the rest return capacity.
        Samples left out (failed episodes of a group trained on its survivors) never reach the buffer."""
        self.drops.settled(msg.ok, msg.reason, msg.detail, msg.left_out if msg.ok else 0)
        if msg.ok and msg.scores and self.selfplay is not None and OPPONENT_KEY in a.metadata:
            self.selfplay.record(a.metadata[OPPONENT_KEY], list(msg.scores))
        # the gate counts samples: a mirror game's episode makes one per seat
        granted = a.num_samples * self._samples_per_episode(a)
        if msg.ok:
            left_out = min(max(msg.left_out, 0), granted)
            if left_out < granted:
                self.gate.accept(granted - left_out)
            if left_out:
                self.gate.reject(left_out)
            self.counts["groups_done"] += 1
        else:
            self.gate.reject(granted)
            self.counts["groups_dropped"] += 1
            reason = msg.reason or "unspecified"
            # the first of each reason in full; the rest are counted (a run that cannot train drops many a
            # second) and the driver warns of a high drop rate with its top cause
            level = logging.WARNING if self.drops.by_reason[reason] == 1 else logging.DEBUG
            log.log(level, "group %s dropped on %s (%s): %s; later drops of this kind are counted "
                    "(controller/groups_dropped/%s)", gid, worker, reason, msg.detail, reason)

    def _samples_per_episode(self, a: Assignment) -> int:
        """Samples one episode of `a` delivers: every seat's in a mirror game (no seat of record), else one."""
        if self.selfplay is None or a.metadata.get(OPPONENT_KEY) != "live" or SEAT_KEY in a.metadata:
            return 1
        return len(self.selfplay.games.get(a.task, ())) or 1

    def _on_published(self, topic: str, msg) -> None:
        if isinstance(msg, WeightsAvailable):
            self.learner_version = max(self.learner_version, msg.version)
            if msg.version > self.gate.state.version:  # re-announcements keep the first time
                self._announced_at.setdefault(msg.version, time.time())
        elif isinstance(msg, Metrics):
            if msg.source.startswith("learner"):
                version = int(msg.scalars.get("train/version", 0))
                self.learner_version = max(self.learner_version, version)
                if version > self.learner_metrics_version:
                    self.learner_step_at = msg.time  # wall clock of the newest learner step
                if not self.learner_up_at:  # its first row: the step began as the learner's set-up ended
                    self.learner_up_at = msg.time - msg.scalars.get("train/step_s", 0.0)
                    self.first_step_at = msg.time
                    self._trained.append((self.learner_up_at, msg.scalars.get("train/samples_total", 0.0)
                                          - msg.scalars.get("train/sequences", 0.0)))
                if "train/samples_total" in msg.scalars:
                    self._trained.append((msg.time, msg.scalars["train/samples_total"]))
                self.learner_metrics_version = max(self.learner_metrics_version, version)
                if msg.source == "learner-0" and (warning := self.signal.observe(msg.scalars)):
                    log.warning("%s", warning)  # once per run (the console shows the controller's warnings)
                    self._record(Metrics(source="driver", step=version, time=msg.time,
                                         scalars={"event/no_signal": 1.0}))
            self._record(msg)

    def trained_per_s(self, window_s: float = 10.0) -> float:
        """Samples the learner trained per second over its steps of the last `window_s` seconds (wall
        clock of its metrics rows; its first step counted from when it began)."""
        if len(self._trained) < 2:
            return 0.0
        t1, n1 = self._trained[-1]
        t0, n0 = next(((t, n) for t, n in self._trained if t >= t1 - window_s), self._trained[0])
        if (t0, n0) == (t1, n1):  # one step in the window: from the row before it
            t0, n0 = self._trained[-2]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _record(self, msg: Metrics) -> None:
        self.last.setdefault(msg.source, {}).update(msg.scalars)
        self.emit(msg)

    # ------------------------------------------------------------------ handing out work

    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.alive]

    def generation_version(self) -> int:
        """The policy version every live worker holds (the oldest of theirs)."""
        live = [w.version for w in self.live_workers()]
        return min(live) if live else 0

    def _advance_version(self) -> None:
        v = self.generation_version()
        if v > self.gate.state.version:
            now = time.time()
            for version in [k for k in self._announced_at if k <= v]:
                self.version_to_all_s.append(now - self._announced_at.pop(version))
            self.gate.set_version(v)
            self._opened_at = max((w.applied_at for w in self.live_workers()), default=0.0) or None
            self._maybe_start_eval(v)

    def _skip_drawn(self, resume: ResumePoint) -> None:
        """Continue each domain's task stream and the domain draws where the interrupted run stopped."""
        for d in self.domains:
            n = resume.tasks.get(d.name, 0)
            for _ in range(n):
                next(d.train)
            self.tasks_drawn[d.name] = n
        for _ in range(resume.draws):
            self.rng.choices(range(len(self.domains)), weights=self.weights.tolist())

    def _dispatch(self) -> None:
        while self.eval_waiting and self.live_workers():  # evaluation goes without credit, first
            self._send_eval(self.eval_waiting.popleft())
        gate_version = self.gate.state.version
        for w in self.live_workers():
            if w.version < gate_version:
                continue  # (re)started behind the others: training work waits until it has the weights
            while w.credits > 0:
                if self.requeued:
                    a = self.requeued.popleft()
                elif self.gate.try_acquire(self.cfg.group_size):
                    a = self._new_assignment()
                    self.counts["groups_granted"] += 1
                    if self._opened_at is not None:
                        self.apply_to_grant_s.append(max(0.0, time.time() - self._opened_at))
                        self._opened_at = None
                else:
                    return
                w.credits -= 1
                self._send(w, a)  # a failed send loses the worker: credits 0, its work handed out again

    def _send(self, w: WorkerState, a: Assignment) -> None:
        w.outstanding[a.group_id] = a
        try:
            self.ch.send(w.peer, a, timeout=5)
        except (ChannelTimeout, PeerUnreachable) as e:  # gone since its last message (killed, crashed)
            log.warning("could not reach %s (%s); its work will be handed out again", w.name, e)
            self.worker_lost(w.name)

    def _new_assignment(self) -> Assignment:
        d = self.domains[int(self.rng.choices(range(len(self.domains)), weights=self.weights.tolist())[0])]
        while True:
            task = check_task(next(d.train), d.plugin, d.where)
            self.tasks_drawn[d.name] += 1
            ids = self._encode(task.prompt, d)
            if ids is not None:
                break
        gid = group_id(d.name, self.next_group)
        self.next_group += 1
        self.numbering.record(Numbering(next_group=self.next_group, tasks=dict(self.tasks_drawn)))
        metadata = dict(task.metadata)
        opponent = self.selfplay.opponent(d.name, self.learner_version) if self.selfplay is not None else None
        if opponent is not None:  # a game: who plays the seats the live policy does not
            metadata[OPPONENT_KEY] = opponent
        if self.cfg.learner.train.advantage.name in GREEDY_BASELINE:  # ReMax: the last member decoded greedily
            metadata[BASELINE_KEY] = "greedy"
        a = Assignment(group_id=gid, prompt_ids=ids, num_samples=self.cfg.group_size, task=d.name,
                       answer=task.answer, sampling=self.train_sampling, metadata=metadata,
                       prompt=task.prompt, domain=task.domain)
        # a mirror game's episodes are group_size samples in all (the plan checked it divides): what the gate granted
        a.num_samples //= self._samples_per_episode(a)
        return a

    def _encode(self, text: str, d: DomainTasks) -> Array | None:
        """The prompt's token ids, or None (skipped, counted) when the tokenizer cannot encode it: the
        first such prompt of each domain is logged with the character that fails."""
        try:
            ids = self.tok.encode(text)
        except Exception as e:
            d.unencodable += 1
            n = self.tasks_skipped[d.name] = self.tasks_skipped.get(d.name, 0) + 1
            why = unencodable(self.tok, text, e)
            if n == 1:
                log.error("domain %r (env %r, %s): %s; such tasks are skipped and counted "
                          "(controller/tasks_skipped/%s)", d.name, d.plugin, d.where, why, d.name)
            if d.unencodable >= MAX_UNENCODABLE:
                raise PluginError(f"domain {d.name!r} (env {d.plugin!r}, {d.where}): {d.unencodable} prompts in a row "
                                  f"cannot be encoded by the model's tokenizer; the last: {why}") from e
            return None
        d.unencodable = 0
        return Array.from_numpy(np.asarray(ids, np.int32))

    def worker_lost(self, name: str) -> None:
        """`name` died or stopped answering: what it held goes to the others."""
        w = self.workers.get(name)
        if w is None:
            return
        w.alive, w.credits, w.version = False, 0, -1
        again = list(w.outstanding.values())
        w.outstanding.clear()
        train = [a for a in again if EVAL_KEY not in a.metadata]
        self.requeued.extend(train)
        self.counts["groups_requeued"] += len(train)
        for a in again:
            if EVAL_KEY in a.metadata:
                self._send_eval(a)
        if again:
            log.warning("worker %s lost: %d groups handed out again", name, len(again))

    def stale_workers(self, timeout: float) -> list[str]:
        now = time.monotonic()
        return [w.name for w in self.live_workers() if now - w.last_seen > timeout]

    def stop_workers(self, reason: str) -> None:
        for w in self.live_workers():
            try:
                self.ch.send(w.peer, Control(command="stop", reason=reason), timeout=2)
            except (ChannelTimeout, PeerUnreachable):
                pass  # gone already; the launcher stops what is left of it

    def max_worker_version(self) -> int:
        return max((w.version for w in self.live_workers()), default=-1)

    def diagnose(self) -> str:
        """What the controller sees, for a stall message: the gate, the buffer, each worker."""
        g = self.gate.state
        buffer = next((v for k, v in self.last.items() if k.startswith("buffer")), {})
        parts = [f"depth gate: capacity {self.gate.capacity()} (version {g.version}, accepted {g.accepted}, "
                 f"in flight {g.in_flight})"
                 + (" - no new group can be handed out until the learner trains more" if self.gate.capacity()
                    < self.cfg.group_size else "")]
        if buffer:
            parts.append("buffer: " + ", ".join(f"{k} {buffer.get(k, 0):.0f}" for k in (
                "depth/ready_samples", "depth/assembling_groups", "depth/outstanding_batches", "total/duplicates",
                "total/dropped")) + (" (duplicates dropped: group ids the buffer had already seen)"
                                     if buffer.get("total/duplicates", 0) else ""))
        waiting = []
        for w in self.workers.values():
            if not w.alive:
                waiting.append(f"{w.name} lost")
            elif w.version < g.version:
                waiting.append(f"{w.name} waits for weights (holds version {w.version}, gate at {g.version})")
            else:
                waiting.append(f"{w.name} at version {w.version}, {len(w.outstanding)} groups out, {w.credits} credits")
        parts.append("workers: " + ("; ".join(waiting) if waiting else "none connected"))
        parts.append(f"learner at version {self.learner_version} waits for a batch of {self.cfg.batch_samples} samples")
        return ". ".join(parts)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, float]:
        g = self.gate.state
        latency = {f"controller/{name}_ms_{stat}": 1e3 * float(f(window))
                   for name, window in (("apply_to_grant", self.apply_to_grant_s), ("version_to_all", self.version_to_all_s),
                                        ("heartbeat_age", self.heartbeat_age_s)) if window
                   for stat, f in (("median", np.median), ("max", np.max))}
        return {**latency, "controller/generation_version": float(self.generation_version()),
                "controller/messages_in": float(self.messages_in),
                "controller/next_group": float(self.next_group),
                "controller/learner_version": float(self.learner_version),
                "controller/workers_alive": float(len(self.live_workers())),
                "controller/gate_in_flight": float(g.in_flight), "controller/gate_accepted": float(g.accepted),
                "controller/gate_capacity": float(self.gate.capacity()),
                **{f"controller/{k}": float(v) for k, v in self.counts.items()},
                **{f"controller/groups_dropped/{k}": float(v) for k, v in self.drops.by_reason.items()},
                "controller/samples_left_out": float(self.drops.samples_left_out),
                "controller/drop_rate": self.drops.rate()[0],  # share of the window's training groups dropped
                **{f"controller/tasks_skipped/{k}": float(v) for k, v in self.tasks_skipped.items()},
                "controller/auth_refused": float(self.auth.refused),
                **{f"controller/protocol_errors/{k}": float(v) for k, v in self.protocol_errors.items()},
                **(self.selfplay.metrics() if self.selfplay is not None else {})}

    def close(self) -> None:
        if self.selfplay is not None:
            self.selfplay.close()
        self.auth.close()
        for ch in (self.ch, self.learner_sub, self.buffer_sub):
            ch.close()
        self.gate.close()
        self.numbering.close()


def _old_gate(path: Path) -> dict[str, int]:
    """The counters an interrupted run left in its gate file (diagnostics only), {} when unreadable."""
    try:
        return json.loads(path.read_bytes().strip().split(b"\n")[-1])
    except (OSError, ValueError, IndexError):
        return {}
