"""The driver's loop over a running run, in named parts: `Supervisor.tick` is one pass of

- `_start`: the starting evaluation once the first worker connects (or the start timeout);
- `_watch_progress`: a run whose learner version stops moving ends as stalled;
- `_on_exit`: what each exited role means: the learner finished, a refused configuration (no restart),
  a crash (restart, up to `launch.max_restarts`);
- `_reap_silent`: a worker that stopped heartbeating is killed and its groups go to the others;
- `_report`: the controller's status to the metrics and the display;
- `_time_budget`: `budget.minutes` stops the learner;
- `_watch_drops`: a run that could train no group for `launch.no_trainable_group_s` ends failed with the
  top cause; a drop rate above `launch.max_drop_rate` is a warning and a `drop_rate` event;
- `_finished`: after the learner's last step, the final evaluation, then the end.

A part that ends the run raises `Stop` (status "failed: ...") or `Stalled` (status "stalled: ...");
`finish` stops the roles and writes final.json whatever happened.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tidal.core.errors import PluginError
from tidal.core.process import EXIT_CONFIG
from tidal.core.protocol import Metrics
from tidal.integration.controller import Controller
from tidal.integration.recipe import RunConfig
from tidal.integration.resume import resume_command
from tidal.integration.signal_watch import NOTHING_LEARNED

log = logging.getLogger("tidal.run")


class Stop(Exception):
    """The run cannot go on; the message says why and where to look."""


class Stalled(Exception):
    """No new policy version for too long."""


class Progress:
    """When the learner's version last moved, to end a run that cannot make progress: no new version
    within max(`timeout`, 20 x the median interval between versions so far) is a stall."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.version = -1
        self.at = time.monotonic()
        self.intervals: list[float] = []

    def update(self, version: int, now: float) -> None:
        if version > self.version:
            if self.version >= 0:
                self.intervals.append((now - self.at) / (version - self.version))
            self.version, self.at = version, now

    def limit(self) -> float:
        if not self.intervals:
            return self.timeout
        return max(self.timeout, 20 * sorted(self.intervals)[len(self.intervals) // 2])

    def stalled(self, now: float) -> float:
        """Seconds without progress when past the limit, else 0."""
        quiet = now - self.at
        return quiet if self.timeout > 0 and quiet > self.limit() else 0.0


def error_file(roles_dir: Path, name: str) -> Path:
    """Where role `name` leaves the message of the error it exited on (tidal.core.process.role_main)."""
    return roles_dir / f"{name}.error"


def role_error(roles_dir: Path, name: str) -> str:
    """The message role `name` left when it last failed, and forget it (a restart starts clean)."""
    path = error_file(roles_dir, name)
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    path.unlink(missing_ok=True)
    return text


def in_recipe_terms(message: str, kind: str) -> str:
    """A role names fields of its own config (`train.loss.name`); the user wrote them in the recipe's
    section for that role (`learner.train.loss.name`)."""
    if kind not in ("learner", "buffer", "rollout"):  # the recipe section of each role kind has its name
        return message
    return re.sub(r"`([A-Za-z_][\w.\[\]]*)`", lambda m: m.group(0) if m.group(1).startswith(kind + ".")
                  else f"`{kind}.{m.group(1)}`", message)


@dataclass
class Supervisor:
    cfg: RunConfig
    run_dir: Path
    kinds: dict[str, str]  # role name -> kind
    controller: Controller
    handle: Any  # the launcher's RunHandle
    sink: Any  # MetricsSink
    display: Any  # Display
    status: str = "completed"
    final_eval: str = "not run"
    time_budget_hit: bool = False
    interrupted: bool = False
    learner_done: bool = False
    done_at: float = 0.0
    rl_start: float | None = None  # wall clock of the starting evaluation: the RL phase begins
    launched_at: float = 0.0  # wall clock when the launcher was asked to start the roles
    restarts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # role -> the message it left when it last failed
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.restarts = {name: 0 for name in self.kinds}
        self.workers = [n for n, k in self.kinds.items() if k == "rollout"]
        self.roles_dir = self.run_dir / "roles"
        self.progress = Progress(self.cfg.launch.stall_timeout_s)
        self._eval0 = False
        self._resume_eval: int | None = None  # a resumed run evaluates its checkpoint once the workers hold it
        self._next_status = 0.0
        self._rl_start_mono = 0.0  # monotonic time of rl_start: the clock of launch.no_trainable_group_s
        self._next_drop_warning = 0.0
        self._first_step_logged = False
        if self.controller.resume is not None:  # elapsed time (and budget.minutes) carry on
            self.t0 -= self.controller.resume.elapsed_s

    # ------------------------------------------------------------------ the loop

    def loop(self) -> None:
        """Until the run ends; sets `status` for the way it ended, except for a crash of the driver."""
        try:
            while not self.tick():
                pass
            c = self.controller
            if self.learner_done and c.learner_version < self.cfg.budget.versions and not self.time_budget_hit:
                self.status = (f"failed: the learner stopped at version {c.learner_version} of "
                               f"{self.cfg.budget.versions}; see {self.run_dir / 'logs' / 'learner'}.log")
            elif self.status == "completed" and c.learner_version == 0 and self.cfg.budget.versions > 0:
                # a run that trained nothing (its time budget spent) did not complete
                self.status = f"failed: {self.untrained()}"
                log.error("%s", self.status)
        except Stalled as e:
            self.status = f"stalled: {e}"
            log.error("run stalled: %s", e)
            self.event("stall")
        except (Stop, PluginError) as e:  # PluginError: a plugin made what the controller cannot send
            self.status = f"failed: {e}"
            log.error("%s", e)
        except BaseException as e:  # a crash of the driver itself: final.json must not say "completed"
            self.status = f"failed: {type(e).__name__}: {e}"
            raise

    def tick(self) -> bool:
        """One pass; True when the run is over."""
        if self.interrupted:
            self.status = "interrupted"
            log.warning("interrupted: stopping every role")
            return True
        self.controller.step(0.05)
        now = time.monotonic()
        self._start(now)
        self._watch_progress(now)
        for name, rc in self.handle.exited().items():
            self._on_exit(name, rc, now)
        self._reap_silent()
        self._report(now)
        self._first_step()
        self._time_budget(now)
        self._watch_drops(now)
        return self._finished(now)

    # ------------------------------------------------------------------ the parts

    def _start(self, now: float) -> None:
        c = self.controller
        if self._eval0:
            if self._resume_eval is not None and c.live_workers() and c.generation_version() >= self._resume_eval:
                # the version every worker holds: the checkpoint's, or a newer one the learner made from
                # samples the buffer kept before the workers caught up (evaluated under its own number)
                if (v := c.generation_version()) not in c.evals:
                    c.start_eval(v)
                self._resume_eval = None
            return
        if self.controller.workers:  # the starting point, on the first worker to connect
            if c.resume is None:
                self.controller.start_eval(0)
            else:  # the checkpoint's weights, once every worker holds them
                self._resume_eval = c.resume.version
            self._eval0, self.rl_start, self._rl_start_mono = True, time.time(), now
            self.progress = Progress(self.cfg.launch.stall_timeout_s)  # the stall clock starts with the roles up
        elif now - self.t0 > self.cfg.launch.start_timeout_s:
            raise Stop(f"no rollout worker connected within {self.cfg.launch.start_timeout_s:.0f} s "
                       f"(see {self.run_dir / 'logs'})")

    def _first_step(self) -> None:
        if not self._first_step_logged and (s := self.launch_to_first_step()) is not None:
            self._first_step_logged = True
            log.info("first trained step %.1f s after the roles were launched", s)

    def _watch_progress(self, now: float) -> None:
        c = self.controller
        self.progress.update(c.learner_version, now)
        quiet = self.progress.stalled(now) if self._eval0 and not self.learner_done else 0.0
        if quiet:
            raise Stalled(f"no new policy version for {quiet:.0f} s (limit {self.progress.limit():.0f} s: "
                          f"launch.stall_timeout_s or 20x the median step); at version "
                          f"{c.learner_version} of {self.cfg.budget.versions}. {c.diagnose()}. " + self.last_errors())

    def _on_exit(self, name: str, rc: int, now: float) -> None:
        if name == "learner" and rc == 0:
            self.learner_done, self.done_at = True, now
            log.info("learner finished %d versions", self.controller.learner_version)
            return
        message = in_recipe_terms(role_error(self.roles_dir, name), self.kinds.get(name, ""))
        if message:
            self.errors[name] = message
        logs = f"{self.run_dir / 'logs' / name}.log"
        if rc == EXIT_CONFIG:  # a refused configuration: a restart would refuse it again
            raise Stop(f"{message or name + ' refused its configuration'} (see {logs})")
        if name == "learner" and self.cfg.learner.checkpoint_every == 0:
            raise Stop(f"learner exited with code {rc} ({message or 'no error reported'}); with "
                       f"learner.checkpoint_every = 0 there is no checkpoint to restart it from. See {logs}")
        self.restarts[name] = self.restarts.get(name, 0) + 1  # a role the launcher added (a node's relay) too
        if self.restarts[name] > self.cfg.launch.max_restarts:
            raise Stop(f"{name} exited with code {rc} {self.restarts[name]} times; last error: "
                       f"{message or '(none reported)'}; see {logs}")
        log.warning("%s exited with code %d: restarting (%d of %d)%s", name, rc, self.restarts[name],
                    self.cfg.launch.max_restarts, f": {message}" if message else "")
        if name in self.workers:
            self.controller.worker_lost(name)
        self.event("restart", **{f"event/restart/{name}": float(self.restarts[name])})
        self.handle.restart(name)

    def _reap_silent(self) -> None:
        timeout = self.cfg.launch.heartbeat_timeout_s
        for name in self.controller.stale_workers(timeout):
            if self.handle.running(name):
                log.warning("%s sent nothing for %.0f s: killing it", name, timeout)
                self.handle.kill(name)
            self.controller.worker_lost(name)

    def _report(self, now: float) -> None:
        if now < self._next_status:
            return
        self._next_status = now + 2.0
        c = self.controller
        self.sink(Metrics(source="controller", step=c.learner_version, time=time.time(), scalars=c.status()))
        self.display.update(c.learner_version, summary(c, now - self.t0))
        write_health(self.run_dir, {"time": time.time(), "restarts": {k: v for k, v in self.restarts.items() if v},
                                    "errors": {**c.last_error, **self.errors}})

    def event(self, kind: str, **scalars: float) -> None:
        """An event row in metrics.jsonl (`tidal report` marks it): source "controller", `event/KIND` = 1
        and the usual time and version fields, plus any detail (`event/restart/ROLE`: that role's
        restarts so far). Kinds: restart, stall, drop_rate (`event/drop_rate/rate`: the share of
        training groups dropped over `launch.drop_rate_window_s`); `tidal run --resume` writes resume."""
        c = self.controller
        self.sink(Metrics(source="controller", step=c.learner_version, time=time.time(),
                          scalars={f"event/{kind}": 1.0, **scalars}))

    def _time_budget(self, now: float) -> None:
        minutes = self.cfg.budget.minutes
        if minutes and now - self.t0 > 60 * minutes and not self.learner_done and not self.time_budget_hit:
            log.info("time budget of %.1f min reached: stopping the learner", minutes)
            self.handle.signal("learner", signal.SIGTERM)
            self.time_budget_hit = True

    def _watch_drops(self, now: float) -> None:
        c, launch = self.controller, self.cfg.launch
        d = c.drops
        if (launch.no_trainable_group_s and self.rl_start is not None and d.trained == 0 and d.dropped
                and now - self._rl_start_mono >= launch.no_trainable_group_s):
            raise Stop(f"no group could be scored in {launch.no_trainable_group_s:g} s: {d.summary()}. "
                       f"Groups dropped by reason: {self._by_reason()}; role logs: {self.run_dir / 'logs'}")
        rate, n = d.rate()
        if rate > launch.max_drop_rate and n >= 4 and now >= self._next_drop_warning:
            self._next_drop_warning = now + launch.drop_rate_window_s
            log.warning("%.0f %% of the last %d training groups were dropped (over %g s; launch.max_drop_rate is "
                        "%g): top cause %s", 100 * rate, n, launch.drop_rate_window_s, launch.max_drop_rate,
                        d.summary())
            self.event("drop_rate", **{"event/drop_rate/rate": rate})

    def untrained(self) -> str:
        """Why a run ended with 0 versions trained, for its status."""
        d = self.controller.drops
        if d.dropped:
            return f"0 versions trained: {d.trained} groups trained on, {d.dropped} dropped: {d.summary()}"
        return f"0 versions trained ({d.trained} groups reached the buffer). {self.controller.diagnose()}"

    def _by_reason(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.controller.drops.by_reason.items())) or "none"

    def _finished(self, now: float) -> bool:
        if not self.learner_done:
            return False
        c, every = self.controller, self.cfg.eval.every
        final = c.learner_version
        if every and final not in c.evals and c.max_worker_version() >= final:
            c.start_eval(final)  # on the workers that already hold the last version
        # the learner's last metrics may still be queued on our subscription: take them first
        settled = c.learner_metrics_version >= final or now - self.done_at > 5
        if settled and not c.eval_pending() and (not every or final in c.evals):
            self.final_eval = "done" if every else "off"
            return True
        if now - self.done_at > self.cfg.eval.final_timeout_s:
            self.final_eval = f"timed out after {self.cfg.eval.final_timeout_s:g} s"
            log.warning("the evaluations still running did not finish within %.0f s (eval.final_timeout_s); "
                        "stopping anyway. %s", self.cfg.eval.final_timeout_s, self.last_errors())
            return True
        return False

    # ------------------------------------------------------------------ the end

    def finish(self, buffer_status: Any) -> None:
        """Stop every role (workers and learner first, then the buffer, whose final counters are read in
        between through `buffer_status()`) and write final.json."""
        c = self.controller
        self.display.update(c.learner_version, summary(c, time.monotonic() - self.t0))
        self.display.close()
        c.stop_workers("run over")
        timeout = self.cfg.launch.shutdown_timeout_s
        codes = self.handle.stop(["learner", *self.workers], timeout, only=True)
        c.drain(1.0)  # the workers' last metrics, sent as they stopped
        final_buffer = buffer_status()
        codes.update(self.handle.stop(["buffer"], timeout))
        log.info("roles stopped: %s", ", ".join(f"{k}={v}" for k, v in codes.items()) or "none running")

        if self.status == "completed" and self.cfg.launch.fail_without_signal and (why := c.signal.learned_nothing()):
            self.status = f"{NOTHING_LEARNED}: {why}"
            log.error("the run %s", self.status)
        write_final(self.run_dir, {
            "status": self.status, "versions": c.learner_version, "budget_versions": self.cfg.budget.versions,
            **({} if self.status == "completed" or self.status.startswith(NOTHING_LEARNED)
               else {"resume": resume_command(self.run_dir)}),
            "resumed": c.resume.resumes + 1 if c.resume is not None else 0,
            "time_budget_reached": self.time_budget_hit, "final_eval": self.final_eval,
            "launch_to_first_step_s": self.launch_to_first_step(),
            "signal": c.signal.summary(),
            "errors": {**c.last_error, **self.errors},
            "restarts": {k: v for k, v in self.restarts.items() if v},
            "eval": c.eval_results, "eval_unscored": c.eval_unscored, "controller": c.status(), "buffer": final_buffer,
            "rollout": {k: v for k, v in sorted(c.last.items()) if k.startswith("rollout")}})
        self.sink(Metrics(source="controller", step=c.learner_version, time=time.time(), scalars=c.status()))

    def launch_to_first_step(self) -> float | None:
        """Seconds from the launch of the roles to the end of the learner's first step of this run (its first
        trained samples): what a user waits before the run learns anything. None before that step."""
        first = self.controller.first_step_at
        return round(first - self.launched_at, 2) if first and self.launched_at else None

    def last_errors(self) -> str:
        """The latest error each role reported (or left when it exited), for a stall or timeout message."""
        c = self.controller
        found = {**c.last_error, **self.errors}
        failed = ", ".join(f"{k} {v}" for k, v in sorted(c.drops.by_reason.items()))
        parts = [f"{k}: {v}" for k, v in sorted(found.items())]
        text = "Last errors: " + (" | ".join(parts) if parts else "none reported")
        if failed:
            text += f". Groups dropped by reason: {failed}"
        return text + f". Role logs: {self.run_dir / 'logs'}"


def write_final(run_dir: Path, final: dict) -> None:
    """`final.json`: how the run ended (status first), what it reached, each role's last error."""
    (run_dir / "final.json").write_bytes(msgspec.json.format(msgspec.json.encode(final)))


def write_health(run_dir: Path, health: dict) -> None:
    """`health.json`, rewritten every few seconds while the run goes on: restarts and each role's last
    error so far (final.json has them at the end); `tidal status` reads it."""
    tmp = run_dir / "health.json.tmp"
    tmp.write_bytes(msgspec.json.encode(health))
    tmp.replace(run_dir / "health.json")


def summary(c: Controller, elapsed: float) -> dict[str, str]:
    """The display's one-screen status."""
    learner = c.last.get("learner-0", {})
    buffer = next((v for k, v in c.last.items() if k.startswith("buffer")), {})
    workers = [v for k, v in c.last.items() if k.startswith("rollout")]
    acc = f"{100 * c.eval_results[-1][1]:.1f}% @v{c.eval_results[-1][0]}" if c.eval_results else "-"
    return {
        "elapsed": f"{elapsed / 60:.1f} min",
        # trained by the learner over its last 10 s of steps; generated: the workers' own rates, each
        # measured over its last metrics interval (0 until a worker's second report)
        "samples/s": f"{c.trained_per_s():.1f}",
        "trained": f"{learner.get('train/samples_total', 0.0):.0f}",
        "generated/s": f"{sum(w.get('rollout/samples_per_s', 0.0) for w in workers):.1f}",
        "gen tokens/s": f"{sum(w.get('rollout/tokens_per_s', 0.0) for w in workers):.0f}",
        "reward": f"{learner.get('reward/mean', float('nan')):.3f}",
        # samples of the last step with a nonzero advantage; groups of equal rewards teach GRPO nothing
        "signal": (f"{100 * learner['signal/nonzero_adv_frac']:.0f}% (equal-reward groups "
                   f"{100 * learner.get('signal/zero_variance_frac', 0.0):.0f}%)"
                   if "signal/nonzero_adv_frac" in learner else "-"),
        "eval acc": acc,
        "buffer depth": f"{buffer.get('depth/ready_samples', 0.0):.0f}",
        "lag": f"{learner.get('staleness/lag_mean', 0.0):.2f}",
        "workers": f"{len(c.live_workers())}",
        "dropped": f"{c.drops.dropped}",  # training groups dropped by a worker (controller/groups_dropped/*)
    }
