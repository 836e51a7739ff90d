"""The run driver behind `tidal run` and `tidal demo`: lays out the roles, starts them through the
configured launcher, plays the controller, restarts what dies, and stops everything at the end.

Role layout (endpoints are loopback ports picked per run):

    rollout-i --Trajectory--> buffer (ingest) --Batch--> learner --WeightsAvailable/Metrics (PUB)--> workers, driver
        ^  WorkRequest/Ack/Heartbeat/Metrics       buffer (publish): acks to workers, Metrics to the driver
        +--------------------- controller (ROUTER, in the driver) ---------------------+

Restart rules: a rollout worker that dies (or stops heartbeating) is restarted and its groups go to the
others; the buffer restarts from its write-ahead log; the learner restarts from its last checkpoint
(the buffer serves the batch it had not acknowledged again). Each role restarts at most
`launch.max_restarts` times; past that the run stops with an error.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from tidal.core.errors import PluginError
from tidal.core.plugins import registry
from tidal.core.process import ERROR_FILE_ENV, EXIT_CONFIG
from tidal.core.protocol import Metrics
from tidal.core.testing import free_endpoint
from tidal.integration.controller import Controller
from tidal.integration.launch import Role
from tidal.integration.learner.parallel import ParallelConfig, check_parallel, model_config
from tidal.integration.monitor import Display, MetricsSink
from tidal.integration.recipe import RunConfig, default_run_dir
from tidal.rollout.worker import DomainSpec

log = logging.getLogger("tidal.run")


@dataclass
class RunResult:
    run_dir: Path
    status: str  # "completed", "interrupted", "stalled: ...", "failed: ..."
    versions: int
    eval: list[tuple[int, float, dict[str, float]]]
    restarts: dict[str, int]
    wall_s: float
    samples: int = 0  # trajectories the learner trained on
    rl_s: float = 0.0  # the RL phase: first worker connected -> the learner's last step (wall clock)
    rl_start: float = 0.0  # its start: time.time() when the first rollout worker connected (roles up)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.rl_s if self.rl_s > 0 else 0.0


def plan(cfg: RunConfig, run_dir: Path, nproc_learner: int = 1) -> tuple[list[Role], dict[str, str]]:
    """The roles of a run and the endpoints they share; each role's config lands in <run_dir>/roles."""
    ep = {k: free_endpoint() for k in ("controller", "ingest", "serve", "buffer_pub", "learner_pub")}
    roles_dir = run_dir / "roles"
    roles_dir.mkdir(parents=True, exist_ok=True)
    sync = cfg.mode == "sync"
    # what the roles must agree on is filled in here; recipe.check refused any other value for these
    buffer = msgspec.structs.replace(
        cfg.buffer, ingest=ep["ingest"], serve=ep["serve"], publish=ep["buffer_pub"],
        wal_dir=str(run_dir / cfg.buffer.wal_dir),  # relative to the run folder (an absolute path stays)
        group_size=cfg.group_size, batch_samples=cfg.batch_samples)
    learner = msgspec.structs.replace(
        cfg.learner, model=cfg.learner.model or cfg.model, buffer=ep["serve"], publish=ep["learner_pub"],
        max_steps=cfg.budget.versions, seed=cfg.seed,
        train=msgspec.structs.replace(cfg.learner.train, temperature=cfg.sampling.temperature),
        wait_for_subscriber_s=cfg.learner.wait_for_subscriber_s or 30.0,  # this driver's controller
        # a learner restarted by this driver resumes from a checkpoint; with checkpoint_every = 0 there is
        # none during the run, so a learner that fails ends the run instead of starting over at version 0
        checkpoint_dir=cfg.learner.checkpoint_dir or str(run_dir / "checkpoints"),
        weights=msgspec.structs.replace(cfg.learner.weights, every=1) if sync else cfg.learner.weights)
    if learner.parallel != ParallelConfig():  # the learner would refuse it at start: say so before any role starts
        check_parallel(learner.parallel, world=nproc_learner, config=model_config(learner.model),
                       backend=learner.backend, attn=learner.backend_options.attn)
    learner_threads, worker_threads = share_threads(os.cpu_count() or 1, cfg.workers, nproc_learner, cfg.launch.threads)
    log.info("torch threads: %d per learner rank, %d per rollout worker", learner_threads, worker_threads)
    roles = [_role("buffer", "buffer", "tidal.buffer", buffer, roles_dir),
             _role("learner", "learner", "tidal.integration.learner", learner, roles_dir, learner_threads)]
    domains = {d.name or d.env: DomainSpec(env=d.env, options=dict(d.options), reward=d.reward) for d in cfg.domains}
    for i in range(cfg.workers):
        w = msgspec.structs.replace(
            cfg.rollout, name=f"rollout-{i}", controller=ep["controller"], buffer_ingest=ep["ingest"],
            buffer_acks=ep["buffer_pub"], weights=ep["learner_pub"], model=cfg.rollout.model or cfg.model,
            domains={**domains, **cfg.rollout.domains},
            engine=msgspec.structs.replace(cfg.rollout.engine, options={"seed": cfg.seed + 1000 * (i + 1),
                                                                        **cfg.rollout.engine.options}))
        roles.append(_role(w.name, "rollout", "tidal.rollout.worker", w, roles_dir, worker_threads))
    return roles, ep


def share_threads(cores: int, workers: int, learner_ranks: int = 1, fixed: int = 0) -> tuple[int, int]:
    """(threads per learner rank, threads per rollout worker). `fixed` > 0 gives every role that many.
    Otherwise half the cores go to the learner's ranks and the rest to the workers, at least one each:
    more threads than cores (or than a role's share) makes OpenMP spin against itself."""
    if fixed > 0:
        return fixed, fixed
    learner = max(1, cores // 2 // max(1, learner_ranks))
    worker = max(1, (cores - learner * learner_ranks) // max(1, workers))
    return learner, worker


def _role(name: str, kind: str, module: str, config, roles_dir: Path, threads: int = 1) -> Role:
    path = roles_dir / f"{name}.json"
    path.write_bytes(msgspec.json.encode(config))
    t = "1" if kind == "buffer" else str(threads)  # torch reads these at start: no oversubscribed cores
    return Role(name=name, kind=kind, module=module, config=path,
                env={"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, ERROR_FILE_ENV: str(error_file(roles_dir, name))})


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


class _Stop(Exception):
    pass


class _Stalled(Exception):
    pass


def _in_recipe_terms(message: str, kind: str) -> str:
    """A role names fields of its own config (`train.loss.name`); the user wrote them in the recipe's
    section for that role (`learner.train.loss.name`)."""
    if kind not in ("learner", "buffer", "rollout"):  # the recipe section of each role kind has its name
        return message
    return re.sub(r"`([A-Za-z_][\w.\[\]]*)`", lambda m: m.group(0) if m.group(1).startswith(kind + ".")
                  else f"`{kind}.{m.group(1)}`", message)


def _last_errors(c: Controller, errors: dict[str, str], run_dir: Path) -> str:
    """The latest error each role reported (or left when it exited), for a stall or timeout message."""
    found = {**c.last_error, **errors}
    failed = ", ".join(f"{k} {v}" for k, v in sorted(c.failed_by_reason.items()))
    parts = [f"{k}: {v}" for k, v in sorted(found.items())]
    text = "Last errors: " + (" | ".join(parts) if parts else "none reported")
    if failed:
        text += f". Groups dropped by reason: {failed}"
    return text + f". Role logs: {run_dir / 'logs'}"


def run(cfg: RunConfig, *, run_dir: Path | None = None, nproc_learner: int = 1) -> RunResult:
    from tidal.rollout.tiny import load_tokenizer

    run_dir = Path(run_dir or default_run_dir(cfg))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg)))
    roles, ep = plan(cfg, run_dir, nproc_learner)
    for r in roles:
        if r.kind == "learner":
            r.nproc = nproc_learner
    launcher = registry.create("launcher", cfg.launcher.name, **cfg.launcher.options)
    sink = MetricsSink(run_dir, cfg.monitor.tensorboard)
    display = Display(cfg.monitor.progress, cfg.budget.versions, cfg.monitor.log_every_s)
    try:  # builds every domain's env (and reward) here, in the driver: bad options fail before any role starts
        controller = Controller(cfg, endpoint=ep["controller"], learner_pub=ep["learner_pub"],
                                buffer_pub=ep["buffer_pub"], run_dir=run_dir, tokenizer=load_tokenizer(cfg.model),
                                emit=sink)
    except Exception as e:
        sink.close()
        _write_final(run_dir, {"status": f"failed: {e}", "versions": 0, "budget_versions": cfg.budget.versions})
        raise
    restarts = {r.name: 0 for r in roles}
    kinds = {r.name: r.kind for r in roles}
    workers = [r.name for r in roles if r.kind == "rollout"]
    errors: dict[str, str] = {}  # role -> the message it left when it last exited with an error
    roles_dir = run_dir / "roles"
    for r in roles:
        error_file(roles_dir, r.name).unlink(missing_ok=True)
    status, t0 = "completed", time.monotonic()
    progress = Progress(cfg.launch.stall_timeout_s)
    time_budget_hit = False
    final_eval = "not run"
    interrupted = False

    def on_signal(sig, _frame):
        nonlocal interrupted
        interrupted = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    log.info("run folder %s (%s mode, %d workers, launcher %s)", run_dir, cfg.mode, cfg.workers, cfg.launcher.name)
    handle = launcher.launch(roles, run_dir)
    learner_done = False
    done_at: float | None = None
    eval0 = False
    rl_start: float | None = None
    next_status = 0.0
    try:
        while True:
            if interrupted:
                status = "interrupted"
                log.warning("interrupted: stopping every role")
                break
            controller.step(0.05)
            now = time.monotonic()
            if not eval0 and controller.workers:  # the starting point, on the first worker to connect
                controller.start_eval(0)
                eval0, rl_start = True, time.time()
                progress = Progress(cfg.launch.stall_timeout_s)  # the stall clock starts with the roles up
            elif not eval0 and now - t0 > cfg.launch.start_timeout_s:
                raise _Stop(f"no rollout worker connected within {cfg.launch.start_timeout_s:.0f} s "
                            f"(see {run_dir / 'logs'})")
            progress.update(controller.learner_version, now)
            quiet = progress.stalled(now) if eval0 and not learner_done else 0.0
            if quiet:
                raise _Stalled(f"no new policy version for {quiet:.0f} s (limit {progress.limit():.0f} s: "
                               f"launch.stall_timeout_s or 20x the median step); at version "
                               f"{controller.learner_version} of {cfg.budget.versions}. "
                               + _last_errors(controller, errors, run_dir))
            for name, rc in handle.exited().items():
                if name == "learner" and rc == 0:
                    learner_done, done_at = True, now
                    log.info("learner finished %d versions", controller.learner_version)
                    continue
                message = _in_recipe_terms(role_error(roles_dir, name), kinds.get(name, ""))
                if message:
                    errors[name] = message
                if rc == EXIT_CONFIG:  # a refused configuration: a restart would refuse it again
                    raise _Stop(f"{message or name + ' refused its configuration'} (see {run_dir / 'logs' / name}.log)")
                if name == "learner" and cfg.learner.checkpoint_every == 0:
                    raise _Stop(f"learner exited with code {rc} ({message or 'no error reported'}); with "
                                f"learner.checkpoint_every = 0 there is no checkpoint to restart it from. See "
                                f"{run_dir / 'logs' / name}.log")
                restarts[name] += 1
                if restarts[name] > cfg.launch.max_restarts:
                    raise _Stop(f"{name} exited with code {rc} {restarts[name]} times; last error: "
                                f"{message or '(none reported)'}; see {run_dir / 'logs' / name}.log")
                log.warning("%s exited with code %d: restarting (%d of %d)%s", name, rc, restarts[name],
                            cfg.launch.max_restarts, f": {message}" if message else "")
                if name in workers:
                    controller.worker_lost(name)
                handle.restart(name)
            for name in controller.stale_workers(cfg.launch.heartbeat_timeout_s):
                if handle.running(name):
                    log.warning("%s sent nothing for %.0f s: killing it", name, cfg.launch.heartbeat_timeout_s)
                    handle.kill(name)
                controller.worker_lost(name)
            if now >= next_status:
                next_status = now + 2.0
                sink(Metrics(source="controller", step=controller.learner_version, time=time.time(),
                             scalars=controller.status()))
                display.update(controller.learner_version, _summary(controller, now - t0))
            if cfg.budget.minutes and now - t0 > 60 * cfg.budget.minutes and not learner_done:
                log.info("time budget of %.1f min reached: stopping the learner", cfg.budget.minutes)
                handle.signal("learner", signal.SIGTERM)
                cfg = msgspec.structs.replace(cfg, budget=msgspec.structs.replace(cfg.budget, minutes=0.0))
                time_budget_hit = True
            if learner_done:
                final = controller.learner_version
                if cfg.eval.every and final not in controller.evals and controller.max_worker_version() >= final:
                    controller.start_eval(final)  # on the workers that already hold the last version
                # the learner's last metrics may still be queued on our subscription: take them first
                settled = controller.learner_metrics_version >= final or now - done_at > 5  # type: ignore[operator]
                if settled and not controller.eval_pending() and (not cfg.eval.every or final in controller.evals):
                    final_eval = "done" if cfg.eval.every else "off"
                    break
                if now - done_at > cfg.eval.final_timeout_s:  # type: ignore[operator]
                    final_eval = f"timed out after {cfg.eval.final_timeout_s:g} s"
                    log.warning("the evaluations still running did not finish within %.0f s (eval.final_timeout_s); "
                                "stopping anyway. %s", cfg.eval.final_timeout_s, _last_errors(controller, errors, run_dir))
                    break
        if learner_done and controller.learner_version < cfg.budget.versions and not time_budget_hit:
            status = (f"failed: the learner stopped at version {controller.learner_version} of "
                      f"{cfg.budget.versions}; see {run_dir / 'logs' / 'learner'}.log")
    except _Stalled as e:
        status = f"stalled: {e}"
        log.error("run stalled: %s", e)
    except (_Stop, PluginError) as e:  # PluginError: a plugin made what the controller cannot send
        status = f"failed: {e}"
        log.error("%s", e)
    except BaseException as e:  # a crash of the driver itself: final.json must not say "completed"
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        display.update(controller.learner_version, _summary(controller, time.monotonic() - t0))
        display.close()
        controller.stop_workers("run over")
        codes = handle.stop(["learner", *workers], cfg.launch.shutdown_timeout_s, only=True)
        final_buffer = _buffer_status(ep["serve"])
        codes.update(handle.stop(["buffer"], cfg.launch.shutdown_timeout_s))
        log.info("roles stopped: %s", ", ".join(f"{k}={v}" for k, v in codes.items()) or "none running")
        _write_final(run_dir, {
            "status": status, "versions": controller.learner_version, "budget_versions": cfg.budget.versions,
            "time_budget_reached": time_budget_hit, "final_eval": final_eval,
            "errors": {**controller.last_error, **errors},
            "restarts": {k: v for k, v in restarts.items() if v},
            "eval": controller.eval_results, "controller": controller.status(), "buffer": final_buffer})
        sink(Metrics(source="controller", step=controller.learner_version, time=time.time(), scalars=controller.status()))
        controller.close()
        sink.close()
        for s, h in old.items():
            signal.signal(s, h)
    samples = int(controller.last.get("learner-0", {}).get("train/samples_total", 0))
    rl_s = controller.learner_step_at - rl_start if rl_start is not None and controller.learner_step_at else 0.0
    return RunResult(run_dir=run_dir, status=status, versions=controller.learner_version,
                     eval=controller.eval_results, restarts={k: v for k, v in restarts.items() if v},
                     wall_s=time.monotonic() - t0, samples=samples, rl_s=rl_s, rl_start=rl_start or 0.0)


def _write_final(run_dir: Path, final: dict) -> None:
    """`final.json`: how the run ended (status first), what it reached, each role's last error."""
    (run_dir / "final.json").write_bytes(msgspec.json.format(msgspec.json.encode(final)))


def _buffer_status(endpoint: str) -> dict[str, float]:
    """The buffer's counters at the end (what it acknowledged and still holds), or {} if it is gone."""
    from tidal.buffer.client import BatchClient
    from tidal.core.errors import ChannelTimeout

    client = BatchClient(endpoint, name="run-end")
    try:
        return dict(client.status(timeout=10).scalars)
    except (ChannelTimeout, OSError) as e:
        log.warning("could not read the buffer's final status: %s", e)
        return {}
    finally:
        client.close()


def _summary(c: Controller, elapsed: float) -> dict[str, str]:
    learner = c.last.get("learner-0", {})
    buffer = next((v for k, v in c.last.items() if k.startswith("buffer")), {})
    workers = [v for k, v in c.last.items() if k.startswith("rollout")]
    acc = f"{100 * c.eval_results[-1][1]:.1f}% @v{c.eval_results[-1][0]}" if c.eval_results else "-"
    return {
        "elapsed": f"{elapsed / 60:.1f} min",
        "samples/s": f"{sum(w.get('rollout/samples_per_s', 0.0) for w in workers):.1f}",
        "trained": f"{learner.get('train/samples_total', 0.0):.0f}",
        "tokens/s": f"{sum(w.get('rollout/tokens_per_s', 0.0) for w in workers):.0f}",
        "reward": f"{learner.get('reward/mean', float('nan')):.3f}",
        "eval acc": acc,
        "buffer depth": f"{buffer.get('depth/ready_samples', 0.0):.0f}",
        "lag": f"{learner.get('staleness/lag_mean', 0.0):.2f}",
        "workers": f"{len(c.live_workers())}",
        "dropped": f"{sum(c.failed_by_reason.values())}",  # groups dropped by a worker (controller/groups_failed/*)
    }
