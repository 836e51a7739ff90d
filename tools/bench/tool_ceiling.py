"""What the calculator is worth to the tool demo's model: its no-tool ceiling against its warm start.

    uv run python tools/bench/tool_ceiling.py [--steps 600] [--eval-size 200]

Trains the model of `tidal demo --task tools` (same size, tool alphabet, seed) twice, for the same SFT
steps: (1) "direct": every demonstration is the exact product, answered at once (no tool) — the best this
model learns to do in its head; (2) "warm": the demo's warm start (the calculator one time in five,
wrong guesses otherwise). Both are evaluated greedily on the held-out multiplications: (1) on `multiply`
with `tools=false` (the first action is the answer), (2) with the calculator. `tidal demo --task tools`
then shows what RL makes of (2); the JSON line gives both accuracies and the warm start's ratio to the
ceiling.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tidal.integration.demo import TOOLS_MODEL, TOOLS_SFT, _tool_demonstrator
from tidal.integration.sft import SFTConfig, episode_accuracy, sft
from tidal.rollout.envs.multiply import Multiply
from tidal.rollout.tiny import TOOL_ALPHABET, build_tiny_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=TOOLS_SFT["steps"], help="SFT steps of each model")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--out", default="", help="folder for the models (default: a temporary one)")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="tidal-tool-ceiling-"))
    model = {**TOOLS_MODEL, "alphabet": TOOL_ALPHABET}
    base = build_tiny_model(out / "init", seed=0, **model)
    cfg = SFTConfig(steps=a.steps, batch=TOOLS_SFT["batch"], lr=TOOLS_SFT["lr"], seed=0)
    results = {}
    for name, demonstrate, options in (("direct", None, {"tools": False}),
                                       ("warm", _tool_demonstrator(TOOLS_SFT["tool_rate"]), {})):
        t0 = time.perf_counter()
        sft(base, out / name, Multiply(), cfg, demonstrate=demonstrate)
        stats = episode_accuracy(out / name, "multiply", options, n=a.eval_size, seed=0)
        results[name] = {**stats, "sft_s": time.perf_counter() - t0}
        print(f"{name:>6}: held-out accuracy {100 * stats['accuracy']:5.1f}%  tool calls/episode "
              f"{stats['tool_calls_per_episode']:.2f}  ({results[name]['sft_s']:.0f} s)", flush=True)
    ceiling = results["direct"]["accuracy"]
    print(json.dumps({"bench": "tool_ceiling", "steps": a.steps, "no_tool_ceiling": ceiling,
                      "warm_start": results["warm"]["accuracy"], "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
