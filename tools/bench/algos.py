"""Loss + backward time of tidal-algos on a 64 x 2,048-token batch, against references in the same run.

    uv run python tools/bench/algos.py [--batch 64] [--tokens 2048] [--reps 20]

References, written plainly, each computing what tidal's loss returns:
  vectorized  the same formula batched over [B, T] with masks, and the same metrics (ratio mean / max /
              min, approx KL, clip fractions), each the obvious one-liner. The goal: tidal's time <= 1.25x
              this one's (what tidal's checks, options and metric plumbing may cost)
  formula     the batched formula alone, no metrics (a floor, for information)
  naive       a per-sequence Python loop, formula alone: how a first implementation looks (for information)

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


def _metrics(logp, old, mask, clip_hits):
    """The metrics tidal's losses return, written plainly (boolean indexing for the valid tokens)."""
    lr = (logp - old).detach()
    r = lr.exp()
    v = r[mask]
    out = [v.mean(), v.max(), v.min(), (torch.expm1(lr) - lr)[mask].mean()]
    return out + [h[mask].float().mean() for h in clip_hits(r)]


def with_metrics(formula, clip_hits):
    def run(logp, old, adv, mask):
        loss = formula(logp, old, adv, mask)
        _metrics(logp, old, mask, lambda r: clip_hits(r, adv))
        return loss

    return run


def tidal_fn(fn, **kw):
    def run(logp, old, adv, mask):
        return fn(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask), **kw).loss

    return run


def _seq_clip(r, adv, lo=3e-4, hi=4e-4):  # gspo clips the sequence ratio: its hits, per token of the sequence
    return [(r > 1 + hi) & (adv > 0), (r < 1 - lo) & (adv < 0)]


# name -> (tidal, vectorized with the same metrics, formula alone, naive loop)
CASES = {
    "ppo (clip-higher)": (tidal_fn(ppo_loss, clip_low=0.2, clip_high=0.28),
                          with_metrics(vec_ppo, lambda r, a: [(r > 1.28) & (a > 0), (r < 0.8) & (a < 0)]),
                          vec_ppo, naive_ppo),
    "gspo": (tidal_fn(gspo_loss), with_metrics(vec_gspo, _seq_clip), vec_gspo, naive_gspo),
    "cispo": (tidal_fn(cispo_loss, clip_high=0.28), with_metrics(vec_cispo, lambda r, a: [r > 1.28, r < 0.0]),
              vec_cispo, naive_cispo),
}
GOAL = 1.25  # tidal's time / vectorized (same outputs) at most


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

    # correctness first: the implementations agree
    for name, fns in CASES.items():
        vals = [f((old + diff), old, adv, mask).item() for f in fns]
        if max(vals) - min(vals) > 1e-4 * max(1.0, abs(vals[0])):
            print(f"{name}: implementations disagree: {vals}", file=sys.stderr)
            return 1

    print(f"batch {args.batch} x {args.tokens} tokens ({int(mask.sum())} valid), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.reps} loss+backward")
    print(f"{'loss':<20}{'tidal ms':>10}{'vector ms':>11}{'formula ms':>12}{'naive ms':>10}"
          f"{'tidal/vector':>14}{'goal':>7}")
    summary: dict[str, dict[str, float]] = {}
    for name, fns in CASES.items():
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(3):  # interleaved, to spread machine noise evenly
            for t, f in zip(times, fns, strict=True):
                t.append(time_it(f, old, diff, adv, mask, args.reps))
        a, v, f, n = (statistics.median(t) for t in times)
        summary[name] = {"tidal_ms": round(a * 1e3, 3), "vectorized_ms": round(v * 1e3, 3),
                         "formula_ms": round(f * 1e3, 3), "naive_ms": round(n * 1e3, 3),
                         "tidal_over_vectorized": round(a / v, 2), "goal_met": a / v <= GOAL}
        print(f"{name:<20}{a * 1e3:>10.2f}{v * 1e3:>11.2f}{f * 1e3:>12.2f}{n * 1e3:>10.2f}{a / v:>14.2f}"
              f"{'<=' + str(GOAL):>7}")
    print("vectorized: the same formula and the same metrics, batched, written plainly; formula: no metrics")
    print(json.dumps({"bench": "algos", "batch": args.batch, "tokens": args.tokens, "results": summary,
                      "goal": {"tidal_over_vectorized_max": GOAL},
                      "goals_met": all(r["goal_met"] for r in summary.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
