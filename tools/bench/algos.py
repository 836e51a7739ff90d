"""Loss + backward time of tidal-algos on a 64 x 2,048-token batch, against references in the same run.

    uv run python tools/bench/algos.py [--batch 64] [--tokens 2048] [--reps 20]

References, written plainly:
  naive       a per-sequence loop: slice each sequence's valid tokens, compute its loss, average —
              how a first implementation usually looks (the goal is tidal / naive >= 1.0)
  vectorized  the same formula batched, without metrics or checks (a floor, for information)

Lengths follow a long tail (most sequences short, a few at the full 2,048) so masks matter.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from tidal.algos import LossInputs, cispo_loss, gspo_loss, ppo_loss


def make_batch(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = (t * torch.rand(b, generator=g) ** 3).clamp(min=16).long()  # long tail
    lengths[: max(1, b // 16)] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=g) * 3
    diff = 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return old, diff, adv, mask


# ---------------------------------------------------------------------- references


def naive_ppo(logp, old, adv, mask, lo=0.2, hi=0.28):
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        r = torch.exp(logp[i, :n] - old[i, :n])
        a = adv[i, :n]
        loss = -torch.min(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
        total = total + loss.sum()
        count += n
    return total / count


def naive_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4):
    losses = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        s = torch.exp((logp[i, :n] - old[i, :n]).mean())
        a = adv[i, 0]
        losses.append(-torch.min(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
    return torch.stack(losses).mean()


def naive_cispo(logp, old, adv, mask, hi=0.28):
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        w = torch.exp(logp[i, :n] - old[i, :n]).detach().clamp(max=1 + hi)
        total = total + (-(w * adv[i, :n] * logp[i, :n])).sum()
        count += n
    return total / count


def vec_ppo(logp, old, adv, mask, lo=0.2, hi=0.28):
    r = torch.exp(logp - old)
    loss = -torch.min(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv)
    m = mask.float()
    return (loss * m).sum() / m.sum()


def vec_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4):
    m = mask.float()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    a = adv[:, 0]
    return (-torch.min(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a)).mean()


def vec_cispo(logp, old, adv, mask, hi=0.28):
    m = mask.float()
    w = torch.exp(logp - old).detach().clamp(max=1 + hi)
    return (-(w * adv * logp) * m).sum() / m.sum()


def tidal_fn(fn, **kw):
    def run(logp, old, adv, mask):
        return fn(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask), **kw).loss

    return run


CASES = {
    "ppo (clip-higher)": (tidal_fn(ppo_loss, clip_low=0.2, clip_high=0.28), naive_ppo, vec_ppo),
    "gspo": (tidal_fn(gspo_loss), naive_gspo, vec_gspo),
    "cispo": (tidal_fn(cispo_loss, clip_high=0.28), naive_cispo, vec_cispo),
}


def time_it(fn, old, diff, adv, mask, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        logp = (old + diff).requires_grad_()
        t0 = time.perf_counter()
        fn(logp, old, adv, mask).backward()
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    old, diff, adv, mask = make_batch(args.batch, args.tokens)

    # correctness first: the three implementations agree
    for name, fns in CASES.items():
        vals = [f((old + diff), old, adv, mask).item() for f in fns]
        if max(vals) - min(vals) > 1e-4 * max(1.0, abs(vals[0])):
            print(f"{name}: implementations disagree: {vals}", file=sys.stderr)
            return 1

    print(f"batch {args.batch} x {args.tokens} tokens ({int(mask.sum())} valid), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.reps} loss+backward")
    print(f"{'loss':<20}{'tidal ms':>10}{'naive ms':>10}{'vector ms':>11}{'tidal/naive':>13}{'tidal/vector':>14}")
    summary: dict[str, dict[str, float]] = {}
    for name, (mine, naive, vec) in CASES.items():
        # interleave to spread machine noise evenly
        t_mine, t_naive, t_vec = [], [], []
        for _ in range(3):
            t_mine.append(time_it(mine, old, diff, adv, mask, args.reps))
            t_naive.append(time_it(naive, old, diff, adv, mask, args.reps))
            t_vec.append(time_it(vec, old, diff, adv, mask, args.reps))
        a, b, c = (statistics.median(x) for x in (t_mine, t_naive, t_vec))
        summary[name] = {"tidal_ms": round(a * 1e3, 3), "naive_ms": round(b * 1e3, 3), "vectorized_ms": round(c * 1e3, 3),
                         "speedup_vs_naive": round(b / a, 2), "speedup_vs_vectorized": round(c / a, 2)}
        print(f"{name:<20}{a * 1e3:>10.2f}{b * 1e3:>10.2f}{c * 1e3:>11.2f}{b / a:>13.2f}{c / a:>14.2f}")
    print(json.dumps({"bench": "algos", "batch": args.batch, "tokens": args.tokens, "results": summary,
                      "goal": {"speedup_vs_naive": 1.0}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
