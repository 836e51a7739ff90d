"""Learner step throughput with packing against padding, same model, same batch, same run.

    uv run python tools/bench/learner.py [--samples 64] [--max-len 512] [--hidden 256 --layers 4] [--reps 3]

Batch: `--samples` sequences whose lengths follow a long tail (most short, a few at `--max-len`), as RL
completions do. Both variants run the same Trainer step (PPO loss, GRPO advantages, AdamW):
  packed   tidal's path: whole sequences packed into rows of `--micro-tokens` with per-sequence
           position ids (no padding, no cross-sequence attention)
  padded   the usual baseline: micro-batches of `--pad-batch` sequences padded to the longest of the
           batch, with an attention mask
Tokens/s counts real (unpadded) tokens. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from tidal.core.config import PluginRef
from tidal.integration.learner.backends import BackendConfig, OptimConfig, SingleBackend
from tidal.integration.learner.data import Sample, pad_rows
from tidal.integration.learner.trainer import TrainConfig, Trainer


def make_batch(n: int, max_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(16, (max_len * rng.random(n) ** 3).astype(int))
    lengths[: max(1, n // 16)] = max_len
    out = []
    for i, total in enumerate(lengths):
        p = int(min(32, total // 4))
        t = int(total - p)
        out.append(Sample(id=str(i), group_id=str(i // 8), prompt=rng.integers(3, vocab, p).astype(np.int32),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--micro-tokens", type=int, default=2048)
    ap.add_argument("--pad-batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from tidal.rollout.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/m", hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                                kv_heads=max(1, args.hidden // 128), intermediate=3 * args.hidden,
                                max_positions=args.max_len + 8)
        cfg = BackendConfig(optim=OptimConfig(lr=1e-5))
        tcfg = TrainConfig(loss=PluginRef(name="ppo"), micro_batch_tokens=args.micro_tokens)
        packed = Trainer(SingleBackend(str(path), cfg), tcfg)
        padded = PaddedTrainer(SingleBackend(str(path), cfg), tcfg, args.pad_batch)
        batch = make_batch(args.samples, args.max_len, packed.backend.model.config.vocab_size)
        real = sum(s.length for s in batch)
        padded_tokens = sum(len(batch[i : i + args.pad_batch]) * max(s.length for s in batch[i : i + args.pad_batch])
                            for i in range(0, len(batch), args.pad_batch))
        packed.step(batch[:4])  # warm-up
        padded.step(batch[:4])
        t_pack, t_pad = [], []
        for _ in range(args.reps):  # interleaved: machine noise hits both alike
            t0 = time.perf_counter()
            packed.step(batch)
            t_pack.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            padded.step(batch)
            t_pad.append(time.perf_counter() - t0)
    a, b = statistics.median(t_pack), statistics.median(t_pad)
    print(f"batch: {args.samples} sequences, {real} real tokens (padding would make {padded_tokens}); "
          f"model hidden {args.hidden} x {args.layers} layers; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'':10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'packed':10}{a:10.3f}{real / a:12.0f}")
    print(f"{'padded':10}{b:10.3f}{real / b:12.0f}")
    print(f"packed / padded: {b / a:.2f}x")
    print(json.dumps({"bench": "learner", "packed_tok_s": real / a, "padded_tok_s": real / b, "ratio": b / a,
                      "real_tokens": real, "padded_tokens": padded_tokens}))


if __name__ == "__main__":
    main()
