"""Peak memory of one MoE layer's forward + backward: naive dense dispatch against tidal-moe-fsdp's lean
block, on the same inputs, weights and routing, measured in the same run.

    uv run python tools/bench/moe.py [--tokens 4096] [--hidden 256] [--ffn 512] [--experts 16] [--top-k 2]

Configurations (router included in all three):
  naive           every expert runs on every token, mixed by a dense [T, E] weight matrix
                  (tidal.moe_fsdp.dense_moe: E × T × (2F + F + H) activations, the baseline)
  lean            MoEBlock: sort by expert, one expert at a time, keeps the [T·k, 2F] projection for backward
  lean+recompute  MoEBlock(recompute=True): keeps no expert activation; backward recomputes one expert at a time

Method: each configuration runs in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536 (so every freed
buffer leaves the resident set at once). Peak = ru_maxrss after forward + backward minus the resident
set just before it (weights, inputs and a small warm-up already in place): the extra memory the layer
needed at its worst moment. Also measured: bytes the autograd graph saved for backward (distinct
storages, via torch.autograd.graph.saved_tensors_hooks) and wall time. The three agree numerically
(checked first, in this process, at a small size). Goal: lean / naive <= 0.5. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from tidal.moe_fsdp import MoEBlock, MoEConfig, dense_moe

MODES = ("naive", "lean", "lean+recompute")


def build(args, mode: str, tokens: int):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_experts=args.experts, top_k=args.top_k,
                    recompute=mode == "lean+recompute")
    block = MoEBlock(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, args.hidden, generator=gen).requires_grad_()
    g = torch.randn(tokens, args.hidden, generator=gen)
    return block, x, g


def forward(block: MoEBlock, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode != "naive":
        return block(x)
    r = block.gate(x)
    return dense_moe(x, r.ids, r.weights, block.experts.gate_up_proj, block.experts.down_proj)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    mode = args.child
    small_block, small_x, small_g = build(args, mode, 8)  # warm-up: lazy initialisation outside the measurement
    (forward(small_block, small_x, mode) * small_g).sum().backward()
    block, x, g = build(args, mode, args.tokens)
    del small_block, small_x, small_g
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    before = _rss()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(block, x, mode)
    (y * g).sum().backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    params = sum(p.untyped_storage().nbytes() for p in block.parameters())
    saved_bytes = sum(v for k, v in saved.items() if k not in {p.data_ptr() for p in block.parameters()}
                      and k != x.data_ptr())
    return {"peak_mib": (peak - before) / 2**20, "saved_mib": saved_bytes / 2**20, "ms": wall * 1e3,
            "params_mib": params / 2**20}


def check_agreement(args) -> float:
    """All three give the same outputs and input gradients (small size, this process)."""
    outs = []
    for mode in MODES:
        block, x, g = build(args, mode, 64)
        y = forward(block, x, mode)
        (y * g).sum().backward()
        outs.append(torch.cat([y.detach().reshape(-1), x.grad.reshape(-1), block.experts.down_proj.grad.reshape(-1)]))
    return max((o - outs[0]).abs().max().item() for o in outs[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per mode; the median is shown")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    err = check_agreement(args)
    if err > 1e-4:
        print(f"naive and lean disagree by {err:.2e}", file=sys.stderr)
        return 1
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    base = [sys.executable, __file__, "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--ffn",
            str(args.ffn), "--experts", str(args.experts), "--top-k", str(args.top_k)]
    results = {}
    for mode in MODES:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([*base, "--child", mode], capture_output=True, text=True, env=env, timeout=900)
            if out.returncode:
                print(f"{mode} failed:\n{out.stderr}", file=sys.stderr)
                return 1
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    print(f"one MoE layer fwd+bwd: T={args.tokens} tokens, H={args.hidden}, F={args.ffn}, E={args.experts}, "
          f"top-{args.top_k}, fp32, median of {args.repeats} process(es), torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"weights {results['naive']['params_mib']:.1f} MiB; max |diff| between modes {err:.1e}")
    naive = results["naive"]
    print(f"{'mode':<16}{'peak MiB':>10}{'saved MiB':>11}{'ms':>9}{'peak/naive':>12}{'saved/naive':>13}")
    for mode, r in results.items():
        r["peak_vs_naive"] = round(r["peak_mib"] / naive["peak_mib"], 3)
        r["saved_vs_naive"] = round(r["saved_mib"] / naive["saved_mib"], 3)
        print(f"{mode:<16}{r['peak_mib']:>10.1f}{r['saved_mib']:>11.1f}{r['ms']:>9.1f}{r['peak_vs_naive']:>12.3f}"
              f"{r['saved_vs_naive']:>13.3f}")
    print(json.dumps({"bench": "moe", "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
                      "experts": args.experts, "top_k": args.top_k, "repeats": args.repeats, "agreement_max_abs": err,
                      "results": {m: {k: round(v, 3) for k, v in r.items()} for m, r in results.items()},
                      "goal": {"peak_vs_naive": 0.5}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
