"""Peak activation memory per rank of sequence-parallel training against sequence length, P = 1, 2, 4
ranks on CPU (gloo), measured; and the longest sequence that fits a fixed memory budget for each P.

    uv run python tools/bench/seqpar.py [--lengths 2048,4096,8192] [--ranks 1,2,4] [--modes ulysses,ring]
                                        [--hidden 256 --mlp 4096 --heads 4 --head-dim 16 --layers 2]
                                        [--block 256] [--budget-mb N]

Workload: a stack of `--layers` pre-norm transformer blocks (q/k/v/o projections around `sp_attention`,
causal, math backend; a GELU MLP), forward + backward of a mean loss, on one sequence of L tokens split
over P ranks (Ulysses all-to-all, or zigzag ring). The baseline is P = 1 in the same run.

How memory is measured (per rank, in a fresh process per configuration): glibc is told to serve every
allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at
once; after the model, the local input and gloo are set up (and a tiny warm-up step has created gloo's
buffers), the resident-set high-water mark is reset (`5` to /proc/self/clear_refs) and VmRSS read; then
one forward + backward runs and the new VmHWM is read. peak = VmHWM − VmRSS: every byte the step made
resident — activations, attention tiles, gradients, communication buffers — at its highest point.
The table shows the largest rank's peak. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tidal.core.process import exit_now


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


class Block(torch.nn.Module):
    def __init__(self, hidden: int, mlp: int, heads: int, head_dim: int, block: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.block = heads, head_dim, block
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * heads * head_dim)
        self.o = torch.nn.Linear(heads * head_dim, hidden)
        self.up, self.down = torch.nn.Linear(hidden, mlp), torch.nn.Linear(mlp, hidden)

    def forward(self, x, layout, mesh):
        from tidal.seqpar import sp_attention

        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        att = sp_attention(qkv[0], qkv[1], qkv[2], layout, mesh, block_size=self.block)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def worker(a: argparse.Namespace) -> None:
    """One rank: set up, reset the high-water mark, run forward + backward, write the peak."""
    import torch.distributed as dist

    from tidal.seqpar import SPMesh, make_mesh, plan_layout

    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world, init_method=f"tcp://127.0.0.1:{a.port}")
        mesh = make_mesh(ulysses=a.world, ring=1) if a.mode == "ulysses" else make_mesh(ulysses=1, ring=a.world)
    else:
        mesh = SPMesh.single()
    torch.manual_seed(0)
    model = torch.nn.ModuleList(Block(a.hidden, a.mlp, a.heads, a.head_dim, a.block) for _ in range(a.layers))

    def step(length: int) -> None:
        layout = plan_layout(length, mesh, causal=True)
        x = torch.randn(1, layout.padded_len // mesh.size, a.hidden, requires_grad=True)
        h = x
        for blk in model:
            h = blk(h, layout, mesh)
        h.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    step(64 * mesh.size)  # creates gloo's pairs and torch's lazy state outside the measurement
    if a.world > 1:
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    t0 = time.perf_counter()
    step(a.length)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    Path(a.out).write_text(json.dumps({"rank": a.rank, "peak": peak, "seconds": seconds}))
    if a.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(a: argparse.Namespace, mode: str, world: int, length: int, tmp: Path) -> dict:
    """Run one configuration in `world` fresh processes; returns the largest rank's peak and time."""
    from tidal.core.testing import free_port

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    outs = [tmp / f"{mode}_{world}_{length}_{r}.json" for r in range(world)]
    common = ["--hidden", str(a.hidden), "--mlp", str(a.mlp), "--heads", str(a.heads), "--head-dim", str(a.head_dim),
              "--layers", str(a.layers), "--block", str(a.block)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--world", str(world),
                               "--port", port, "--mode", mode, "--length", str(length), "--out", str(outs[r]), *common],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode} P={world} L={length} failed:\n" + "\n".join(logs))
    ranks = [json.loads(o.read_text()) for o in outs]
    return {"peak": max(r["peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,8192", help="comma-separated sequence lengths")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated SP degrees P")
    ap.add_argument("--modes", default="ulysses,ring", help="ulysses and/or ring (for P > 1)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=256, help="attention tile size (sp_attention's block_size)")
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="memory budget per rank (default: the P = 1 peak at the second-shortest length)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--length"):
        ap.add_argument(name, type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ulysses", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        exit_now(0)  # no interpreter finalization: gloo's threads can abort it after the work is done
    lengths = [int(x) for x in a.lengths.split(",")]
    ranks = [int(x) for x in a.ranks.split(",")]
    modes = a.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tidal-bench-seqpar-") as tmp:
        for length in lengths:
            base = measure(a, "single", 1, length, Path(tmp)) if 1 in ranks else None
            if base:
                rows.append({"mode": "single", "P": 1, "L": length, **base})
            for mode in modes:
                for p in (r for r in ranks if r > 1):
                    rows.append({"mode": mode, "P": p, "L": length, **measure(a, mode, p, length, Path(tmp))})
    single = {r["L"]: r["peak"] for r in rows if r["P"] == 1}
    budget = a.budget_mb * 2**20 if a.budget_mb else single.get(lengths[min(1, len(lengths) - 1)])
    print(f"{'mode':8} {'P':>2} {'L':>7} {'peak MiB/rank':>14} {'× single':>9} {'goal ≤1.2/P':>12} {'step s':>7}")
    for r in rows:
        ratio = r["peak"] / single[r["L"]] if r["L"] in single else float("nan")
        r["ratio"] = ratio
        goal = 1.2 / r["P"]
        ok = "-" if r["P"] == 1 else ("yes" if ratio <= goal else "NO")
        print(f"{r['mode']:8} {r['P']:>2} {r['L']:>7} {r['peak'] / 2**20:>14.1f} {ratio:>9.3f} "
              f"{f'{goal:.2f} {ok}':>12} {r['seconds']:>7.1f}")
    fits = {}
    if budget:
        print(f"\nlongest measured length within {budget / 2**20:.0f} MiB per rank:")
        for mode in ["single", *modes]:
            for p in ranks:
                got = [r["L"] for r in rows if r["mode"] == mode and r["P"] == p and r["peak"] <= budget]
                if (mode == "single") == (p == 1):
                    fits[f"{mode}/P{p}"] = max(got) if got else None
                    print(f"  {mode:8} P={p}: {fits[f'{mode}/P{p}']}")
    print(json.dumps({"bench": "seqpar", "budget_bytes": budget, "rows": rows, "longest_within_budget": fits,
                      "shape": {k: getattr(a, k) for k in ("hidden", "mlp", "heads", "head_dim", "layers", "block")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
