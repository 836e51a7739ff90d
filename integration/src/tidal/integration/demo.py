"""`tidal demo`: a real asynchronous RL run on a CPU machine, from nothing, in a few minutes.

1. Build a tiny Llama-style model and a character tokenizer locally (no hub download).
2. Warm-start it with a short SFT on the arithmetic task's train split (RL needs a policy that
   sometimes succeeds): two-digit plus one-digit additions, shown by an imperfect demonstrator who
   forgets the carry 60 % of the time. The warm start answers the no-carry problems and only sometimes
   carries; RL, rewarded by the exact answer alone, has to find and fix that (it never sees a corrected
   demonstration). Held-out problems (1 in 5 by prompt hash) are never trained on.
3. Run async GRPO: rollout workers (embedded engine; 1 on a machine of 2 cores or fewer, else 2), the
   buffer, the learner and the controller, all real processes talking over ZeroMQ, weights sent to the
   workers in flight after every step.
4. Write the report (PNG + summary.json) and print where it is.

`tidal demo --task tools` runs the agentic variant: multi-digit multiplication (``347*58=``) that the
tiny model cannot do in its head but can with a calculator (``<calc>347*58</calc>``, answered with
``<result>20126</result>``). The warm start imitates a demonstrator that calls the calculator only 20 %
of the time and otherwise guesses a wrong product; async GRPO, rewarded by the exact final answer alone,
has to learn to call the tool. Episodes run in environment processes beside each rollout worker; the
report plots the tool-call and tool-error rates.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from tidal.core.config import apply_overrides, parse_override, to_dict
from tidal.core.episodes import is_episodic
from tidal.core.plugins import registry
from tidal.integration.recipe import RunConfig, check, read_recipe, recipes_dir
from tidal.integration.report import report
from tidal.integration.run import run
from tidal.rollout import tiny
from tidal.rollout.envs.multiply import demonstration
from tidal.rollout.envs.nim import demonstration as nim_demonstration

log = logging.getLogger("tidal.demo")


def demo_workers(cores: int = 0) -> int:
    """Rollout workers for the demo on `cores` (0: the cores this process may use). On 2 cores, 2 workers
    beside the learner are 3 busy processes on 2 cores, and 1 worker is the faster loop (the paired runs
    are in the CHANGELOG); on more cores, 2 workers."""
    if not cores:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cores <= 2 else 2


# The demo's warm start: the tiny model it builds and its SFT. Its RL phase is the task's recipe,
# integration/recipes/<task>.toml, as `tidal run` reads it. Everything can be overridden from the command
# line: `tidal demo budget.versions=40 sft.steps=200 model_build.hidden=64`.
DEMO_MODEL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
DEMO_SFT = {"steps": 1000, "batch": 64, "lr": 1e-3, "carry_slip": 0.6}
TOOLS_MODEL = {**DEMO_MODEL, "alphabet": "TOOL_ALPHABET"}  # the char alphabet plus < > _ (tidal.rollout.tiny)
TOOLS_SFT = {"steps": 600, "batch": 64, "lr": 1e-3, "tool_rate": 0.2}
# self-play (nim): the warm start learns the game's format from random legal moves, none of its strategy
SELFPLAY_SFT = {"steps": 300, "batch": 64, "lr": 1e-3}


class DemoTask(NamedTuple):
    recipe: str  # its file in integration/recipes/
    model: dict[str, Any]  # build_tiny_model's options
    sft: dict[str, Any]  # SFTConfig's, plus the demonstrator's (carry_slip, tool_rate)


TASKS = {"arithmetic": DemoTask("arithmetic.toml", DEMO_MODEL, DEMO_SFT),
         "tools": DemoTask("tools.toml", TOOLS_MODEL, TOOLS_SFT),
         "selfplay": DemoTask("selfplay.toml", DEMO_MODEL, SELFPLAY_SFT)}


def demo_overrides(task: str) -> list[str]:
    """What the demo sets on top of its recipe, before the user's overrides."""
    if task == "arithmetic":
        # the demo's run is named for it; its worker count follows this machine (demo_workers)
        return ['name="demo"', f"workers={demo_workers()}"]
    if task == "selfplay":
        return ['name="demo-selfplay"', f"workers={demo_workers()}"]
    return ['name="demo-tools"']  # its recipe's 2 workers: its episodes also run in environment processes


class DemoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: dict = msgspec.field(default_factory=lambda: dict(DEMO_MODEL))
    sft: dict = msgspec.field(default_factory=lambda: dict(DEMO_SFT))


def demo_config(out: Path, overrides: list[str], task: str = "arithmetic") -> tuple[RunConfig, DemoOptions]:
    """The task's recipe with the demo's and then the user's overrides (those of model_build.* and sft.*
    go to the warm start); the model is the warm start's, the run folder OUT/run unless run_dir is given."""
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: the demo has tasks {', '.join(TASKS)}")
    t = TASKS[task]
    ours = [o for o in overrides if parse_override(o)[0][0] in ("model_build", "sft")]
    warm = apply_overrides({"model_build": dict(t.model), "sft": dict(t.sft)}, ours)
    opts = DemoOptions(model=warm["model_build"], sft=warm["sft"])
    recipe = [o for o in overrides if o not in ours]
    cfg = read_recipe(recipes_dir() / t.recipe, [*demo_overrides(task), *recipe])
    return msgspec.structs.replace(cfg, model=str(out / "model-sft"), run_dir=cfg.run_dir or str(out / "run")), opts


def demo(out: str | Path, overrides: Sequence[str] = (), task: str = "arithmetic") -> int:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, opts = demo_config(out, list(overrides), task)
    t0 = time.monotonic()
    warm = warm_start(cfg, opts, out)
    check(cfg)
    run_dir = Path(cfg.run_dir)
    if run_dir == out / "run" and run_dir.exists():  # the demo's own folder: a rerun starts over, it does
        import shutil  # not resume the last run's final checkpoint

        shutil.rmtree(run_dir)
    (out / "demo.json").write_bytes(msgspec.json.format(msgspec.json.encode({"recipe": to_dict(cfg), **warm})))
    train = cfg.learner.train
    print(f"[3/4] {cfg.mode} RL (loss {train.loss.name}, advantage {train.advantage.name}): "
          f"{cfg.workers} rollout worker{'s' if cfg.workers != 1 else ''}, buffer, learner, controller "
          f"({cfg.budget.versions} versions or {cfg.budget.minutes:g} min); logs in {Path(cfg.run_dir) / 'logs'}",
          flush=True)
    result = run(cfg)
    png = report(result.run_dir)
    print(f"[4/4] report: {png}", flush=True)
    if result.eval:
        first, last = result.eval[0], result.eval[-1]
        best = max(result.eval, key=lambda e: e[1])
        print(f"      held-out accuracy {100 * first[1]:.1f}% at version {first[0]} -> {100 * last[1]:.1f}% at "
              f"version {last[0]} (best {100 * best[1]:.1f}%); run {result.wall_s / 60:.1f} min, "
              f"total {(time.monotonic() - t0) / 60:.1f} min; status {result.status}", flush=True)
    print(f"      RL phase: {result.samples} samples trained in {result.rl_s:.1f} s = {result.samples_per_s:.0f} "
          f"samples/s", flush=True)
    if result.first_step_s is not None:
        print(f"      first trained step {result.first_step_s:.1f} s after the roles were launched", flush=True)
    return 0 if result.status == "completed" else 1


def warm_start(cfg: RunConfig, opts: DemoOptions, out: Path) -> dict[str, Any]:
    """The demo's warm start at cfg.model (a tiny model, then SFT on the first domain), reused when
    OUT/model-sft.json says it was made with the same model, SFT, domain and seed; returns those settings."""
    # torch: the warm start's, loaded when it runs (demo_config and `tidal demo --help` need none)
    from tidal.integration.sft import SFTConfig
    from tidal.integration.sft_stage import sft_stage

    domain = cfg.domains[0]
    env = registry.build("env", domain.env.name, domain.env.options, field="domains[0].env")
    sft_opts = dict(opts.sft)
    tool_rate = sft_opts.pop("tool_rate", None)
    sft_cfg = SFTConfig(**{"seed": cfg.seed, **sft_opts})
    model_opts = dict(opts.model)
    if model_opts.get("alphabet") == "TOOL_ALPHABET":
        model_opts["alphabet"] = tiny.TOOL_ALPHABET
    warm = {"model": opts.model, "sft": opts.sft, "domain": to_dict(domain), "seed": cfg.seed}
    stamp = out / "model-sft.json"
    if stamp.is_file() and msgspec.json.decode(stamp.read_bytes()).get("warm") == warm and Path(cfg.model).is_dir():
        prior = msgspec.json.decode(stamp.read_bytes())
        print(f"[1-2/4] reusing the warm-started model in {cfg.model} (same model and SFT settings; "
              f"held-out accuracy {100 * prior['accuracy']:.1f}%); delete it to redo", flush=True)
    else:
        print(f"[1/4] building a tiny model and a character tokenizer in {out / 'model-init'}", flush=True)
        base = tiny.build_tiny_model(out / "model-init", seed=cfg.seed, **model_opts)
        print(f"[2/4] warm start: {sft_cfg.steps} SFT steps on {domain.env.name} {domain.env.options}"
              + (f" (the demonstrator calls the tool {100 * tool_rate:.0f}% of the time)" if tool_rate is not None
                 else " (random legal moves: the format, not the strategy)" if domain.env.name == "nim"
                 else ""), flush=True)
        demonstrate = _tool_demonstrator(tool_rate) if tool_rate is not None else \
            nim_demonstration if domain.env.name == "nim" else None
        # the first stage of `tidal sft RECIPE`, with the demo's demonstrators (tidal.integration.sft_stage)
        stage = sft_stage(cfg, cfg.model, base=base, steps=sft_cfg.steps, batch=sft_cfg.batch, lr=sft_cfg.lr,
                          demonstrate=demonstrate, sft_options=dataclasses.asdict(sft_cfg), measure=False,
                          say=lambda line: None if "SFT:" in line or "SFT done" in line else print(line, flush=True))
        start_acc = _warm_accuracy(cfg, env)
        print(f"      SFT done in {stage.seconds:.0f} s: loss {stage.loss:.3f}, held-out accuracy "
              f"{100 * start_acc:.1f}% (greedy)", flush=True)
        stamp.write_bytes(msgspec.json.encode({"warm": warm, "accuracy": start_acc, "seconds": stage.seconds}))
    return warm


def _tool_demonstrator(tool_rate: float):
    """The multiply demonstrator (tidal.rollout.envs.multiply), its final answer ended by the turn's stop."""
    def show(task, rng):
        segments = demonstration(task, rng, tool_rate=tool_rate)
        text, trained = segments[-1]
        return [*segments[:-1], (text + "\n", trained)]

    return show


def _warm_accuracy(cfg: RunConfig, env) -> float:
    """Greedy held-out accuracy of the warm start, as the run's evaluation will measure it."""
    from tidal.integration.sft import accuracy, episode_accuracy  # torch, as in demo()

    d = cfg.domains[0]
    if not is_episodic(env):
        return accuracy(cfg.model, env, n=cfg.eval.size, seed=cfg.seed, max_tokens=cfg.sampling.max_tokens)
    ep = cfg.rollout.episodes
    stats = episode_accuracy(cfg.model, d.env.name, dict(d.env.options), n=cfg.eval.size, seed=cfg.seed,
                             max_tokens=cfg.sampling.max_tokens, stop=tuple(cfg.sampling.stop),
                             episode_tokens=ep.max_tokens, renderer=ep.renderer.name)
    if d.env.name == "nim":  # a game: held-out accuracy is the win-rate against the scripted player
        print(f"      warm start: {stats['turns_per_episode']:.2f} moves per game; held-out accuracy = games won "
              f"against the scripted player ({d.env.options.get('scripted', 'random')})", flush=True)
    else:
        print(f"      warm start: {stats['tool_calls_per_episode']:.2f} tool calls per episode, tool errors "
              f"{100 * stats['tool_error_rate']:.1f}%, {stats['turns_per_episode']:.2f} turns", flush=True)
    return stats["accuracy"]
