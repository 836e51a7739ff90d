"""`tidal demo`: a real asynchronous RL run on a CPU machine, from nothing, in a few minutes.

1. Build a tiny Llama-style model and a character tokenizer locally (no hub download).
2. Warm-start it with a short SFT on the arithmetic task's train split (RL needs a policy that
   sometimes succeeds): two-digit plus one-digit additions, shown by an imperfect demonstrator who
   forgets the carry 60 % of the time. The warm start answers the no-carry problems and only sometimes
   carries; RL, rewarded by the exact answer alone, has to find and fix that (it never sees a corrected
   demonstration). Held-out problems (1 in 5 by prompt hash) are never trained on.
3. Run async GRPO: 2 rollout workers (embedded engine), the buffer, the learner and the controller, all
   real processes talking over ZeroMQ, weights sent to the workers in flight after every step.
4. Write the report (PNG + summary.json) and print where it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from tidal.core.config import apply_overrides, convert, to_dict
from tidal.integration.recipe import RunConfig, check

log = logging.getLogger("tidal.demo")

# The demo's model, warm start and recipe. Everything can be overridden from the command line:
# `tidal demo budget.versions=40 sft.steps=200`.
DEMO: dict = {
    "name": "demo",
    "seed": 0,
    "group_size": 8,
    "batch_groups": 8,
    "max_staleness": 2,
    "workers": 2,
    "domains": [{"env": "arithmetic", "options": {"level": 5}}],
    "sampling": {"temperature": 1.0, "max_tokens": 6, "stop": ["\n"]},
    "eval": {"every": 10, "size": 200, "temperature": 0.0},  # level 5 holds out ~180 problems: all of them
    "budget": {"versions": 120, "minutes": 8.0},
    "monitor": {"log_every_s": 2.0},  # progress lines when the output is not a terminal
    # 16 groups per worker: engine steps of up to 128 sequences, where a tiny model's step costs about
    # what 64 do (vs_trl: async 1.03k -> 1.1-1.3k samples/s against 8); the depth gate still bounds lag
    "rollout": {"max_groups": 16, "heartbeat_interval_s": 1.0, "metrics_interval_s": 2.0,
                "engine": {"name": "embedded", "options": {"max_num_seqs": 128}}},
    "buffer": {"fsync": "never"},
    "learner": {
        "train": {"loss": {"name": "ppo", "options": {"clip_low": 0.2, "clip_high": 0.28}},
                  "advantage": {"name": "grpo"}, "correction": {"name": "tis", "options": {"cap": 2.0}}},
        "backend_options": {"optim": {"lr": 1e-4}},
        "checkpoint_every": 10,
        "weights": {"transport": "zmq", "final_wait_s": 60.0},
    },
}
DEMO_MODEL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
DEMO_SFT = {"steps": 1000, "batch": 64, "lr": 1e-3, "carry_slip": 0.6}


class DemoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: dict = msgspec.field(default_factory=lambda: dict(DEMO_MODEL))
    sft: dict = msgspec.field(default_factory=lambda: dict(DEMO_SFT))


def demo_config(out: Path, overrides: list[str]) -> tuple[RunConfig, DemoOptions]:
    data = {**msgspec.json.decode(msgspec.json.encode(DEMO)), "model_build": dict(DEMO_MODEL), "sft": dict(DEMO_SFT)}
    apply_overrides(data, overrides)
    opts = DemoOptions(model=data.pop("model_build"), sft=data.pop("sft"))
    data.setdefault("run_dir", str(out / "run"))
    data["model"] = str(out / "model-sft")
    return convert(data, RunConfig, source="tidal demo"), opts


def demo(out: str | Path, overrides: Sequence[str] = ()) -> int:
    from tidal.integration.report import report
    from tidal.integration.run import run
    from tidal.integration.sft import SFTConfig, accuracy, sft
    from tidal.rollout.tasks import Arithmetic
    from tidal.rollout.tiny import build_tiny_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, opts = demo_config(out, list(overrides))
    t0 = time.monotonic()
    options: dict[str, Any] = dict(cfg.domains[0].options)  # Arithmetic checks its own options
    env = Arithmetic(**options)
    sft_cfg = SFTConfig(**{"seed": cfg.seed, **opts.sft})
    warm = {"model": opts.model, "sft": opts.sft, "domain": to_dict(cfg.domains[0]), "seed": cfg.seed}
    stamp = out / "model-sft.json"
    if stamp.is_file() and msgspec.json.decode(stamp.read_bytes()).get("warm") == warm and Path(cfg.model).is_dir():
        prior = msgspec.json.decode(stamp.read_bytes())
        print(f"[1-2/4] reusing the warm-started model in {cfg.model} (same model and SFT settings; "
              f"held-out accuracy {100 * prior['accuracy']:.1f}%); delete it to redo", flush=True)
    else:
        print(f"[1/4] building a tiny model and a character tokenizer in {out / 'model-init'}", flush=True)
        base = build_tiny_model(out / "model-init", seed=cfg.seed, **opts.model)
        print(f"[2/4] warm start: {sft_cfg.steps} SFT steps on {cfg.domains[0].env} {cfg.domains[0].options}",
              flush=True)
        stats = sft(base, cfg.model, env, sft_cfg, progress=_sft_progress(sft_cfg.steps))
        start_acc = accuracy(cfg.model, env, n=cfg.eval.size, seed=cfg.seed, max_tokens=cfg.sampling.max_tokens)
        print(f"      SFT done in {stats['seconds']:.0f} s: loss {stats['loss']:.3f}, held-out accuracy "
              f"{100 * start_acc:.1f}% (greedy)", flush=True)
        stamp.write_bytes(msgspec.json.encode({"warm": warm, "accuracy": start_acc, "seconds": stats["seconds"]}))
    check(cfg)
    run_dir = Path(cfg.run_dir)
    if run_dir == out / "run" and run_dir.exists():  # the demo's own folder: a rerun starts over, it does
        import shutil  # not resume the last run's final checkpoint

        shutil.rmtree(run_dir)
    (out / "demo.json").write_bytes(msgspec.json.format(msgspec.json.encode({"recipe": to_dict(cfg), **warm})))
    print(f"[3/4] {cfg.mode} GRPO: {cfg.workers} rollout workers, buffer, learner, controller "
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
    return 0 if result.status == "completed" else 1


def _sft_progress(total: int):
    every = max(1, total // 10)

    def show(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"      SFT step {step}/{total}  loss {loss:.3f}", flush=True)

    return show
