"""Learner step: what a packed row costs, against padding and against a dense mask over the row.

    uv run python tools/bench/learner.py [--samples 64] [--max-len 512] [--hidden 256 --layers 4] [--reps 3]

Batch: `--samples` sequences in groups of 8 that share a prompt, with completion lengths that follow a
long tail (most short, a few at `--max-len`), as RL completions do. Every variant runs the same Trainer
step (PPO loss, GRPO advantages, AdamW) in the same process, interleaved:
  varlen   tidal's default: rows of `--micro-tokens`, attention `tidal_varlen` (each sequence attends
           to itself only, Σ len² work), each group's prompt once per row
  dense    the same rows under transformers' SDPA with its block-diagonal [row, row] mask (row_len² work:
           what the learner did before tidal_varlen)
  padded   the usual baseline: micro-batches of `--pad-batch` sequences padded to the longest, masked
Then a sweep over the row budget (`--sweep`): with the batch fixed, Σ len² is fixed while Σ row_len² grows
with the budget; varlen's step time must follow the first, dense's follows the second.
Tokens/s counts real (unpadded, unshared) tokens.

Sequence parallelism (`--sp-len`, `--sp-modes`): one learner step (the same Trainer, `learner.parallel.sp`)
on one sequence of `--sp-len` tokens (a 32-token prompt, the rest completion), at sp = 1 (one process) and
sp = 2 (two gloo processes, Ulysses and/or ring), `--threads` torch threads per rank, each configuration in
fresh processes after a warm-up step. Peak activation memory per rank is measured with saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`): the bytes of every distinct storage autograd saves for
backward during the step's forward (parameters excluded), at its highest (the end of the forward, before
backward frees it); the largest rank's is reported. Step time: the median of `--reps` steps (the slowest
rank). Goal: sp = 2 holds <= 0.6x the activations of sp = 1 per rank.

Entropy bonus (`--entropy-len`, 0 skips): one step on one sequence of `--entropy-len` tokens with a
`--entropy-vocab`-token vocabulary (where the logits dominate activation memory), PPO with
entropy_coef = 0 (the entropy is still computed, for the metric) against entropy_coef = 0.01 (its
gradient flows: tidal's entropy saves only the log-distribution its log_softmax keeps anyway) and against
0.01 with autograd's own entropy (which would save the probabilities and a mask too). Peak saved bytes
as above, step time the median of `--reps`, in this process.

Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tidal.core.config import PluginRef
from tidal.core.process import exit_now
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample, pad_rows
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig


def make_batch(n: int, max_len: int, vocab: int, seed: int = 0, group: int = 8) -> list[Sample]:
    rng = np.random.default_rng(seed)
    p = int(min(32, max(2, max_len // 8)))
    lengths = np.maximum(p + 4, (max_len * rng.random(n) ** 3).astype(int))
    lengths[: max(1, n // 16)] = max_len
    prompts = [rng.integers(3, vocab, p).astype(np.int32) for _ in range(n // group + 1)]
    out = []
    for i, total in enumerate(lengths):
        t = int(total - p)
        out.append(Sample(id=str(i), group_id=str(i // group), prompt=prompts[i // group],
                          completion=rng.integers(3, vocab, t).astype(np.int32),
                          logprobs=(-rng.random(t) * 3).astype(np.float32), versions=np.zeros(t, np.int32),
                          reward=float(rng.integers(0, 2)), loss_mask=np.ones(t, bool)))
    return out


class PaddedTrainer(Trainer):
    """The baseline: fixed-size micro-batches padded to their longest sequence, attention-masked."""

    def __init__(self, backend, cfg, pad_batch: int) -> None:
        super().__init__(backend, cfg)
        self.pad_batch = pad_batch

    def step(self, samples):
        from tidal.algos.types import LossInputs

        adv, _ = self.advantages(samples)
        total = float(sum(int(s.loss_mask.sum()) for s in samples))
        for start in range(0, len(samples), self.pad_batch):
            ss = samples[start : start + self.pad_batch]
            width = max(s.length for s in ss)
            ids = torch.zeros(len(ss), width, dtype=torch.long)
            attn = torch.zeros(len(ss), width, dtype=torch.long)
            for i, s in enumerate(ss):
                ids[i, : s.length] = torch.from_numpy(np.concatenate([s.prompt, s.completion]))
                attn[i, : s.length] = 1
            logits = self.backend.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            lps = []
            for i, s in enumerate(ss):
                p, t = len(s.prompt), len(s.completion)
                lp = torch.log_softmax(logits[i, p - 1 : p - 1 + t].float(), -1)
                lps.append(lp.gather(1, ids[i, p : p + t, None])[:, 0])
            tw = max(len(s.completion) for s in ss)
            inputs = LossInputs(
                logprobs=pad_rows(lps, tw),
                behaviour_logprobs=pad_rows([torch.from_numpy(s.logprobs) for s in ss], tw),
                advantages=pad_rows([adv[start + i] for i in range(len(ss))], tw),
                mask=pad_rows([torch.from_numpy(s.loss_mask) for s in ss], tw, False).bool(),
            )
            out = self.loss_fn(inputs)
            (out.loss * float(inputs.mask.sum()) / total).backward()
        return self.backend.clip_and_step()


def timed(trainers: dict[str, Trainer], batch: list[Sample], reps: int) -> dict[str, float]:
    for t in trainers.values():
        t.step(batch[:4])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(reps):  # interleaved: machine noise hits every variant alike
        for k, t in trainers.items():
            t0 = time.perf_counter()
            t.step(batch)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class SavedBytes:
    """Bytes autograd holds for backward: every distinct storage a saved tensor lives in (views of one
    storage count once, parameters not at all), from `reset` to the end of the forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        return t

    def reset(self) -> None:  # a micro-batch's backward has freed what its forward saved
        self.seen.clear()
        self.now = 0


def sp_worker(a: argparse.Namespace) -> None:
    """One rank of one sequence-parallel configuration: warm-up step, then `reps` measured steps."""
    import torch.distributed as dist

    from tidal.integration.learner.parallel import setup_sequence_parallel
    from tidal.learner.config import ParallelConfig

    torch.set_num_threads(a.threads)
    if a.world > 1:
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world, init_method=f"tcp://127.0.0.1:{a.port}")
    torch.manual_seed(0)
    be = SingleBackend(a.model, BackendConfig(optim=OptimConfig(lr=1e-5)))
    sp = setup_sequence_parallel(ParallelConfig(sp=a.world, sp_mode=a.mode), be)
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo"), micro_batch_tokens=a.sp_len), sp=sp)
    rng = np.random.default_rng(0)
    vocab = be.model.config.vocab_size

    def sample(length: int) -> Sample:
        t = length - 32
        return Sample(id="long", group_id="g", prompt=rng.integers(3, vocab, 32).astype(np.int32),
                      completion=rng.integers(3, vocab, t).astype(np.int32),
                      logprobs=(-rng.random(t) * 3).astype(np.float32), versions=np.zeros(t, np.int32), reward=1.0,
                      loss_mask=np.ones(t, bool))

    saved = SavedBytes(be.model)
    backward = be.backward

    def counted_backward(loss: torch.Tensor, last: bool) -> None:
        backward(loss, last)
        saved.reset()

    be.backward = counted_backward
    trainer.step([sample(min(a.sp_len, 256))])  # optimizer state, gloo's buffers, lazy init: not measured
    batch = [sample(a.sp_len)]
    times = []
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        for _ in range(a.reps):
            if a.world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            trainer.step(batch)
            times.append(time.perf_counter() - t0)
    Path(a.out).write_text(json.dumps({"rank": a.rank, "peak": saved.peak, "seconds": statistics.median(times)}))
    if a.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def sp_measure(a: argparse.Namespace, model: str, mode: str, world: int, tmp: str) -> dict:
    """One configuration in `world` fresh processes: the largest rank's peak, the slowest rank's time."""
    from tidal.core.testing import free_port

    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    port = str(free_port())
    outs = [Path(tmp) / f"sp_{mode}_{world}_{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, "--sp-worker", "--rank", str(r), "--world", str(world),
                               "--port", port, "--mode", mode, "--model", model, "--out", str(outs[r]),
                               "--sp-len", str(a.sp_len), "--reps", str(a.reps), "--threads", str(a.threads)],
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
        raise SystemExit(f"sp={world} {mode} failed:\n" + "\n".join(log[-3000:] for log in logs))
    ranks = [json.loads(o.read_text()) for o in outs]
    return {"peak": max(r["peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def sp_section(a: argparse.Namespace, tmp: str) -> dict:
    from tidal.rollout.tiny import build_tiny_model

    heads = max(2, a.hidden // 64)  # Ulysses over 2 ranks needs at least 2 heads
    path = str(build_tiny_model(f"{tmp}/sp", hidden=a.hidden, layers=a.layers, heads=heads, kv_heads=max(1, heads // 2),
                                intermediate=3 * a.hidden, max_positions=a.sp_len + 8))
    one = sp_measure(a, path, "ulysses", 1, tmp)
    out = {"sp_len": a.sp_len, "sp1_peak_bytes": one["peak"], "sp1_s": one["seconds"], "modes": {}}
    print(f"\nsequence parallelism: one {a.sp_len}-token sequence, one learner step, {a.threads} thread(s) per rank; "
          f"peak activation memory per rank (saved-tensor hooks)")
    print(f"{'':14}{'peak MiB/rank':>14}{'vs sp=1':>9}{'step s':>9}{'vs sp=1':>9}")
    print(f"{'sp=1':14}{one['peak'] / 2**20:14.1f}{1:8.2f}x{one['seconds']:9.3f}{1:8.2f}x")
    for mode in [m for m in a.sp_modes.split(",") if m]:
        two = sp_measure(a, path, mode, 2, tmp)
        mem, t = two["peak"] / one["peak"], two["seconds"] / one["seconds"]
        print(f"{'sp=2 ' + mode:14}{two['peak'] / 2**20:14.1f}{mem:8.2f}x{two['seconds']:9.3f}{t:8.2f}x")
        out["modes"][mode] = {"peak_bytes": two["peak"], "s": two["seconds"], "memory_ratio": mem, "time_ratio": t}
    return out


def _autograd_entropy(logp: torch.Tensor) -> torch.Tensor:
    """The entropy as plain autograd would differentiate it (the bench's comparison only)."""
    return -torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp)).sum(-1)


def entropy_section(a: argparse.Namespace, tmp: str) -> dict:
    """Peak saved bytes and step time of one long sequence, with and without the entropy bonus."""
    from tidal.integration.learner import data
    from tidal.rollout.tiny import build_tiny_model

    alphabet = "".join(chr(0x4E00 + i) for i in range(a.entropy_vocab))  # one token per character
    path = build_tiny_model(f"{tmp}/vocab", hidden=a.hidden, layers=2, heads=a.hidden // 64,
                            kv_heads=max(1, a.hidden // 128), intermediate=3 * a.hidden,
                            max_positions=a.entropy_len + 8, alphabet=alphabet)
    rng = np.random.default_rng(0)
    t = a.entropy_len - 32
    vocab = len(alphabet)
    sample = Sample(id="long", group_id="g", prompt=rng.integers(3, vocab, 32).astype(np.int32),
                    completion=rng.integers(3, vocab, t).astype(np.int32),
                    logprobs=(-rng.random(t) * 3 - np.log(vocab)).astype(np.float32), versions=np.zeros(t, np.int32),
                    reward=1.0, loss_mask=np.ones(t, bool))
    plain = data.processed_entropy
    out = {}
    for name, coef, entropy in (("no bonus", 0.0, plain), ("bonus", 0.01, plain),
                                ("bonus, autograd entropy", 0.01, _autograd_entropy)):
        data.processed_entropy = entropy
        be = SingleBackend(str(path), BackendConfig(optim=OptimConfig(lr=1e-5)))
        trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo", options={"entropy_coef": coef}),
                                          micro_batch_tokens=a.entropy_len))
        trainer.step([sample])  # optimizer state: not measured
        saved, times = SavedBytes(be.model), []
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            for _ in range(a.reps):
                saved.reset()
                t0 = time.perf_counter()
                trainer.step([sample])
                times.append(time.perf_counter() - t0)
        out[name] = {"peak": saved.peak, "s": statistics.median(times)}
    data.processed_entropy = plain
    base = out["no bonus"]
    print(f"\nentropy bonus: one {a.entropy_len}-token sequence, vocabulary {vocab}, hidden {a.hidden} x 2 layers; "
          f"peak saved bytes of the step's forward")
    print(f"{'':26}{'peak MiB':>10}{'vs none':>9}{'step s':>9}{'vs none':>9}")
    for name, r in out.items():
        print(f"{name:26}{r['peak'] / 2**20:10.1f}{r['peak'] / base['peak']:8.2f}x{r['s']:9.3f}{r['s'] / base['s']:8.2f}x")
    return {"len": a.entropy_len, "vocab": vocab, **{k.replace(" ", "_").replace(",", ""): v for k, v in out.items()}}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--micro-tokens", type=int, default=4096)
    ap.add_argument("--pad-batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", default="512,1024,2048,4096", help="row budgets (tokens) for the scaling sweep")
    ap.add_argument("--sp-len", type=int, default=4096, help="sequence length of the sequence-parallel step")
    ap.add_argument("--sp-modes", default="ulysses,ring", help="sp = 2 modes to measure; '' skips the section")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank in the sequence-parallel runs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per sequence-parallel configuration")
    ap.add_argument("--entropy-len", type=int, default=2048, help="sequence of the entropy-bonus section; 0 skips it")
    ap.add_argument("--entropy-vocab", type=int, default=32000, help="vocabulary of the entropy-bonus section's model")
    ap.add_argument("--only-entropy", action="store_true", help="run the entropy-bonus section alone")
    ap.add_argument("--sp-worker", action="store_true", help=argparse.SUPPRESS)
    for internal in ("--rank", "--world", "--port"):
        ap.add_argument(internal, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ulysses", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    return ap.parse_args()


def measure(args: argparse.Namespace) -> dict:
    """One step of the batch with each attention / batching variant, then the row-budget sweep."""
    from tidal.integration.learner.data import pack
    from tidal.rollout.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/m", hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                                kv_heads=max(1, args.hidden // 128), intermediate=3 * args.hidden,
                                max_positions=args.max_len + 8)

        def trainer(attn: str, micro: int, share: bool = True, cls=Trainer, **kw) -> Trainer:
            cfg = BackendConfig(attn=attn, optim=OptimConfig(lr=1e-5))
            tcfg = TrainConfig(loss=PluginRef(name="ppo"), micro_batch_tokens=micro, share_prompts=share)
            return cls(SingleBackend(str(path), cfg), tcfg, **kw)

        main_variants = {"varlen": trainer("tidal_varlen", args.micro_tokens),
                         "varlen/no-share": trainer("tidal_varlen", args.micro_tokens, share=False),
                         "dense": trainer("sdpa", args.micro_tokens),
                         "padded": trainer("sdpa", args.micro_tokens, cls=PaddedTrainer, pad_batch=args.pad_batch)}
        batch = make_batch(args.samples, args.max_len, main_variants["varlen"].backend.model.config.vocab_size)
        t = timed(main_variants, batch, args.reps)
        del main_variants
        sweep = []
        for budget in [int(x) for x in args.sweep.split(",") if x]:
            budget = max(budget, max(s.length for s in batch))
            rows = pack(batch, budget)
            ts = timed({"varlen": trainer("tidal_varlen", budget, share=False), "dense": trainer("sdpa", budget)},
                       batch, args.reps)
            sweep.append({"row_budget": budget, "rows": len(rows), "sum_row_len_sq": sum(r.tokens ** 2 for r in rows),
                          "varlen_s": ts["varlen"], "dense_s": ts["dense"]})
    padded = sum(len(batch[i : i + args.pad_batch]) * max(s.length for s in batch[i : i + args.pad_batch])
                 for i in range(0, len(batch), args.pad_batch))
    return {"t": t, "sweep": sweep, "real": sum(s.length for s in batch), "sum_sq": sum(s.length ** 2 for s in batch),
            "padded_tokens": padded}


def report(args: argparse.Namespace, m: dict) -> None:
    t, sweep, real, sum_sq = m["t"], m["sweep"], m["real"], m["sum_sq"]
    print(f"batch: {args.samples} sequences in groups of 8 sharing a prompt, {real} real tokens, Σ len² {sum_sq} "
          f"(padding would make {m['padded_tokens']} tokens); model hidden {args.hidden} x {args.layers} layers; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'':18}{'seconds':>10}{'tokens/s':>12}{'vs varlen':>11}")
    for k, v in t.items():
        print(f"{k:18}{v:10.3f}{real / v:12.0f}{v / t['varlen']:10.2f}x")
    print(f"\nscaling (sequences alone, no prompt sharing): Σ len² = {sum_sq} whatever the row budget")
    print(f"{'row budget':>10}{'rows':>6}{'Σ row_len²':>12}{'varlen s':>10}{'dense s':>10}{'dense/varlen':>13}")
    for r in sweep:
        print(f"{r['row_budget']:10}{r['rows']:6}{r['sum_row_len_sq']:12}{r['varlen_s']:10.3f}{r['dense_s']:10.3f}"
              f"{r['dense_s'] / r['varlen_s']:12.2f}x")
    if len(sweep) > 1:
        v_growth = sweep[-1]["varlen_s"] / sweep[0]["varlen_s"]
        d_growth = sweep[-1]["dense_s"] / sweep[0]["dense_s"]
        print(f"largest / smallest budget: Σ row_len² x{sweep[-1]['sum_row_len_sq'] / sweep[0]['sum_row_len_sq']:.1f}, "
              f"varlen time x{v_growth:.2f}, dense time x{d_growth:.2f}")


def main() -> None:
    args = parse_args()
    if args.sp_worker:
        sp_worker(args)
        exit_now(0)  # no interpreter finalization: gloo's threads can abort it after the work is done
    entropy = None
    if args.entropy_len:
        with tempfile.TemporaryDirectory() as tmp:
            entropy = entropy_section(args, tmp)
    if args.only_entropy:
        print(json.dumps({"bench": "learner", "entropy": entropy}))
        return
    m = measure(args)
    report(args, m)
    sp = None
    if args.sp_modes:
        with tempfile.TemporaryDirectory() as tmp:
            sp = sp_section(args, tmp)
    t = m["t"]
    print(json.dumps({"bench": "learner", "real_tokens": m["real"], "padded_tokens": m["padded_tokens"],
                      "sum_len_sq": m["sum_sq"], **{f"{k.replace('/', '_')}_tok_s": m["real"] / v for k, v in t.items()},
                      "dense_over_varlen": t["dense"] / t["varlen"], "padded_over_varlen": t["padded"] / t["varlen"],
                      "sweep": m["sweep"], "sp": sp, "entropy": entropy}))


if __name__ == "__main__":
    main()
