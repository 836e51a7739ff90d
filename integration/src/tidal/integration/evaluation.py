"""The controller's held-out evaluation rounds: every `eval.every` versions, once every worker holds that
version, each domain's held-out problems go out as evaluation groups (sent without credit; workers score
them and return the `Trajectory` to the controller instead of to the buffer). The round's accuracy is
reported, and the best version so far is pinned as `checkpoints/best`.

`Evaluations` is a part of `tidal.integration.controller.Controller` (its base class), kept in a file of
its own; it uses the controller's workers, domains and sending.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tidal.core.episodes import OPPONENT_KEY, SEAT_KEY
from tidal.core.protocol import Ack, Assignment, Metrics, eval_group_id
from tidal.learner.best import pin_best
from tidal.rollout.worker.process import EVAL_KEY

if TYPE_CHECKING:
    from collections import deque

    from tidal.core.arrays import Array
    from tidal.core.protocol import SamplingParams
    from tidal.integration.domains import DomainTasks
    from tidal.integration.recipe import RunConfig
    from tidal.integration.resume import ResumePoint
    from tidal.integration.selfplay import SelfPlay
    from tidal.integration.workers import WorkerState

log = logging.getLogger("tidal.controller")


@dataclass
class EvalRound:
    version: int
    started: float
    expected: dict[str, str]  # group id -> domain
    rewards: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # group id -> why it could not be scored
    versions: list[int] = field(default_factory=list)  # policy versions of the eval tokens

    @property
    def done(self) -> bool:
        return len(self.rewards) + len(self.failed) >= len(self.expected)


MAX_EVAL_ATTEMPTS = 3  # an evaluation problem aborted (by a weight update) this often is counted as failed


class Evaluations:
    """The evaluation rounds of the controller, by version; the history carries over resumes."""

    if TYPE_CHECKING:  # the controller's, which this part uses
        cfg: RunConfig
        resume: ResumePoint | None
        domains: list[DomainTasks]
        eval_sampling: SamplingParams
        eval_waiting: deque[Assignment]
        eval_attempts: dict[str, int]
        selfplay: SelfPlay | None

        def live_workers(self) -> list[WorkerState]: ...
        def _encode(self, text: str, d: DomainTasks) -> Array | None: ...
        def _send(self, w: WorkerState, a: Assignment) -> None: ...
        def _record(self, msg: Metrics) -> None: ...

    def _init_evals(self, run_dir: Path) -> None:
        cfg, resume = self.cfg, self.resume
        self.evals: dict[int, EvalRound] = {}
        self._next_eval = cfg.eval.every
        self.eval_results: list[tuple[int, float, dict[str, float]]] = []  # (version, accuracy, per domain)
        self.eval_unscored: list[int] = []  # versions whose evaluation scored no problem (no accuracy)
        self.checkpoint_dir = Path(cfg.learner.checkpoint_dir or run_dir / "checkpoints")  # best/ pinned there
        if resume is not None:  # the history goes on; evaluated versions are not evaluated again
            self.eval_results = list(resume.evals)
            for v, _, _ in resume.evals:
                self.evals[v] = EvalRound(v, -1.0, {})
            if cfg.eval.every:
                self._next_eval = (resume.version // cfg.eval.every + 1) * cfg.eval.every

    def _maybe_start_eval(self, version: int) -> None:
        every = self.cfg.eval.every
        if not every or version in self.evals:
            return
        if version >= self._next_eval or version >= self.cfg.budget.versions:
            self._next_eval = (version // every + 1) * every
            self.start_eval(version)

    def start_eval(self, version: int) -> None:
        """Evaluate the held-out problems on the workers that hold `version` (or newer)."""
        if not any(d.eval for d in self.domains) or not self._eval_workers(version):
            return
        expected: dict[str, str] = {}
        for d in self.domains:
            for i, task in enumerate(d.eval):
                ids = self._encode(task.prompt, d)
                if ids is None:
                    continue
                gid = eval_group_id(version, d.name, i)
                expected[gid] = d.name
                self._send_eval(Assignment(group_id=gid, prompt_ids=ids, num_samples=1, task=d.name,
                                           answer=task.answer, sampling=self.eval_sampling,
                                           metadata={**task.metadata, EVAL_KEY: str(version), **self._seat(d, i)},
                                           prompt=task.prompt, domain=task.domain))
        if not expected:  # every prompt was unencodable (logged, counted): nothing to wait for
            log.warning("evaluation at version %d skipped: no held-out prompt could be encoded", version)
            self.evals[version] = EvalRound(version, -1.0, expected)
            return
        self.evals[version] = EvalRound(version, time.monotonic(), expected)
        log.info("evaluation at version %d: %d held-out problems", version, len(expected))

    def _eval_workers(self, version: int) -> list[WorkerState]:
        return [w for w in self.live_workers() if w.version >= version]

    def _seat(self, d: DomainTasks, i: int) -> dict[str, str]:
        """A held-out game's opponent (selfplay.eval_opponent) and the live policy's seat, which alternates
        over the held-out games (roles[i % len(roles)]); {} for a domain that is no game."""
        opponent = self.selfplay.eval_for(d.name) if self.selfplay is not None else None
        if opponent is None or self.selfplay is None:
            return {}
        roles = self.selfplay.games[d.name]
        return {OPPONENT_KEY: opponent, SEAT_KEY: roles[i % len(roles)]}

    def _send_eval(self, a: Assignment) -> None:
        ready = self._eval_workers(int(a.metadata[EVAL_KEY])) or self.live_workers()
        if not ready:  # waits for a live worker; never sent as training work (it would use up credits)
            self.eval_waiting.append(a)
            return
        self._send(min(ready, key=lambda w: len(w.outstanding)), a)

    def _eval_failed(self, a: Assignment, msg: Ack) -> None:
        """An evaluation group came back unscored. An abort (a weight update caught it) is tried again, a
        few times; a scoring error is final and counted in the round, which then still finishes."""
        tries = self.eval_attempts[a.group_id] = self.eval_attempts.get(a.group_id, 0) + 1
        if msg.reason == "abort" and tries < MAX_EVAL_ATTEMPTS:
            self._send_eval(a)
            return
        rnd = self.evals.get(int(a.metadata[EVAL_KEY]))
        if rnd is not None:
            rnd.failed[a.group_id] = msg.detail or msg.reason

    def _finish_evals(self) -> None:
        for v, rnd in list(self.evals.items()):
            if not rnd.done or rnd.started < 0:
                continue
            rnd.started = -1.0  # reported
            if not rnd.rewards:
                self._unscored_eval(v, rnd)
                continue
            per: dict[str, list[float]] = {}
            for gid, r in rnd.rewards.items():
                per.setdefault(rnd.expected[gid], []).append(r)
            # accuracy counts full successes (reward 1); partial credit only shapes training
            acc = float(np.mean([r >= 1.0 for r in rnd.rewards.values()]))
            by_domain = {d: float(np.mean([r >= 1.0 for r in rs])) for d, rs in per.items()}
            # the run's best so far (the history carries over resumes); version 0 is the starting model itself
            if v > 0 and all(acc > a for _, a, _ in self.eval_results):
                self._pin_best(v, acc)
            self.eval_results.append((v, acc, by_domain))
            self.eval_results.sort(key=lambda e: e[0])  # rounds may finish out of order
            if rnd.failed:  # accuracy is over the problems that were scored; the rest are counted, not zeroed
                log.warning("eval at version %d: %d of %d problems could not be scored, e.g. %s", v, len(rnd.failed),
                            len(rnd.expected), next(iter(rnd.failed.values())))
            scalars = {"eval/accuracy": acc,
                       "eval/reward": float(np.mean(list(rnd.rewards.values()))),
                       "eval/failed": float(len(rnd.failed)),
                       "eval/version": float(v),
                       "eval/token_version_min": float(min(rnd.versions, default=v)),
                       "eval/problems": float(len(rnd.rewards))}
            scalars.update({f"eval/{d}/accuracy": a for d, a in by_domain.items()})
            log.info("eval at version %d: accuracy %.3f %s", v, acc,
                     " ".join(f"{d}={a:.3f}" for d, a in by_domain.items()))
            self._record(Metrics(source="controller", step=v, time=time.time(), scalars=scalars))

    def _unscored_eval(self, v: int, rnd: EvalRound) -> None:
        """An evaluation that scored nothing has no accuracy (0.0 would read as a model that is always
        wrong): it is recorded as unscored (final.json `eval_unscored`, the report) and never pinned as best."""
        self.eval_unscored.append(v)
        log.warning("eval at version %d scored nothing: %d of %d problems could not be scored, e.g. %s; no accuracy "
                    "is reported", v, len(rnd.failed), len(rnd.expected), next(iter(rnd.failed.values()), "?"))
        self._record(Metrics(source="controller", step=v, time=time.time(), scalars={
            "eval/unscored": 1.0, "eval/failed": float(len(rnd.failed)), "eval/version": float(v)}))

    def _pin_best(self, version: int, acc: float) -> None:
        try:
            pinned = pin_best(self.checkpoint_dir, version)
        except OSError as e:
            log.warning("could not pin version %d as %s: %s", version, self.checkpoint_dir / "best", e)
            return
        if pinned is None:
            log.info("eval at version %d is the best so far (accuracy %.3f) but no kept checkpoint holds it, so %s "
                     "stays as it was: make eval.every a multiple of learner.checkpoint_every", version, acc,
                     self.checkpoint_dir / "best")
        else:
            log.info("version %d pinned as %s (accuracy %.3f)", version, pinned, acc)

    def eval_pending(self) -> bool:
        return any(r.started >= 0 for r in self.evals.values())
