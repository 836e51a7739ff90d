"""The embedded engine against plain `model.generate` on the same model, in one run.

    uv run python tools/bench/engine.py [--requests 256] [--concurrency 64] [--max-tokens 128]
                                        [--hidden 128 --layers 2] [--reps 3]
    uv run python tools/bench/engine.py --shape demo [--model runs/bench-vs-trl/model-sft] [--rounds 20]

Workload: `--requests` prompts of 16 tokens, each with its own stop length drawn from a long tail (most
short, a few at `--max-tokens`), sampled at temperature 1. `model.generate` runs them in batches of
`--concurrency` (the same prompt length, so no prompt padding) and each batch runs until its longest
row stops, with per-row stopping criteria; the engine keeps `--concurrency` sequences in flight and
lets each one leave when it stops. Tokens/s counts only the tokens each request asked for, for both.

Also measured: the pause an in-flight weight update causes — the time the engine's loop is stopped
while the new tensors are copied in (`last_update_pause_s`), with all sequences mid-generation.

Prints a table and one JSON line. Goal: engine / generate >= 2x; update pause <= 10 ms on a tiny model.

`--shape demo` measures the demo's rollouts instead (`tidal demo`, tools/bench/vs_trl.py): arithmetic
level-5 prompts (~5 tokens), groups of 8 samples of one prompt, 8 groups (64 samples) per round, up to
`--demo-tokens` new tokens, stop on the newline token, temperature 1, one torch thread (`--threads`), as
one rollout worker runs them. `model.generate` takes each round as one batch of 64; the engine gets each
group as the worker submits it (one `submit_many` per group) and runs a round to its end ("rounds"),
and also keeps 8 groups in flight, a new one joining as one finishes ("in flight", the worker's steady
state; same total samples). The random tiny model rarely says a newline, so every completion runs to
the limit; `--model` takes a warm-started folder (vs_trl's runs/bench-vs-trl/model-sft) whose answers
stop like the demo's. `--shape both` runs both workloads. Goal: engine / generate >= 1.5x on this shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import torch


def stop_lengths(n: int, max_tokens: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = (max_tokens * torch.rand(n, generator=g) ** 3).clamp(min=4).long()  # long tail
    lengths[torch.randperm(n, generator=g)[: max(1, n // 16)]] = max_tokens
    return lengths.tolist()


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def run_generate(model, prompt_ids, lengths, concurrency: int, max_tokens: int) -> float:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class PerRowLength(StoppingCriteria):
        def __init__(self, prompt_len: int, want: torch.Tensor) -> None:
            self.prompt_len, self.want = prompt_len, want

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.prompt_len) >= self.want

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for start in range(0, len(prompt_ids), concurrency):
        ids = torch.tensor(prompt_ids[start : start + concurrency], device=model.device)
        want = torch.tensor(lengths[start : start + concurrency], device=model.device)
        batch_max = int(want.max())
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=batch_max,
                stopping_criteria=StoppingCriteriaList([PerRowLength(ids.shape[1], want)]),
                pad_token_id=model.config.pad_token_id, eos_token_id=None,
            )
    sync()
    return time.perf_counter() - t0


def run_engine(engine, prompt_ids, lengths, tag: str) -> float:
    from tidal.core.interfaces import GenerationRequest
    from tidal.core.protocol import SamplingParams

    reqs = [GenerationRequest(request_id=f"{tag}{i}", prompt_ids=p,
                              sampling=SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i))
            for i, (p, n) in enumerate(zip(prompt_ids, lengths, strict=True))]
    t0 = time.perf_counter()
    results = list(engine.generate(reqs, timeout=3600))
    elapsed = time.perf_counter() - t0
    assert sum(len(r.completion_ids) for r in results) == sum(lengths)
    return elapsed


def measure_pause(engine, model, prompt_ids, updates: int = 10) -> dict[str, float]:
    """Pause of in-flight updates with every slot busy: loop-stopped time and caller-side latency."""
    from tidal.core.interfaces import GenerationRequest
    from tidal.core.protocol import SamplingParams

    state = {k: v.clone() for k, v in model.state_dict().items()}
    reqs = [GenerationRequest(request_id=f"pause{i}", prompt_ids=p,
                              sampling=SamplingParams(max_tokens=100_000 // len(prompt_ids), ignore_eos=True))
            for i, p in enumerate(prompt_ids)]
    for r in reqs:
        engine.submit(r)
    while engine.load_state()["running"] < len(reqs) or engine.load_state()["decode_steps"] < 5:
        time.sleep(0.005)
    pauses, latencies = [], []
    for _ in range(updates):
        t0 = time.perf_counter()
        engine.update_weights(state.items(), version=engine.version + 1)
        latencies.append(time.perf_counter() - t0)
        pauses.append(engine.load_state()["last_update_pause_s"])
        time.sleep(0.02)
    engine.abort([r.request_id for r in reqs])
    done = 0
    while done < len(reqs):
        done += len(engine.poll(timeout=30))
    return {"pause_ms_median": 1e3 * statistics.median(pauses), "pause_ms_max": 1e3 * max(pauses),
            "update_call_ms_median": 1e3 * statistics.median(latencies)}


def demo_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """`n` arithmetic level-5 training prompts (`a+b=`), grouped by length so a batch of 8 needs no padding."""
    from tidal.rollout.envs.tasks import Arithmetic, first_tasks

    return [tokenizer.encode(t.prompt, add_special_tokens=False) for t in first_tasks(Arithmetic(level=5), "train",
                                                                                        seed, n)]


def demo_generate(model, prompts: list[list[int]], group: int, max_tokens: int, newline: int) -> tuple[float, int]:
    """`model.generate` on one round: every prompt repeated `group` times, one batch; (seconds, samples)."""
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    t0 = time.perf_counter()
    for same in by_len.values():  # a+b= with a two-digit a and a one-digit b: one length in practice
        ids = torch.tensor([p for p in same for _ in range(group)], device=model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=max_tokens, eos_token_id=newline,
                           pad_token_id=model.config.pad_token_id)
    return time.perf_counter() - t0, len(prompts) * group


def demo_requests(prompts, group: int, max_tokens: int, newline: int, tag: str):
    from tidal.core.interfaces import GenerationRequest
    from tidal.core.protocol import SamplingParams

    return [[GenerationRequest(request_id=f"{tag}{g}:{i}", prompt_ids=p, sampling=SamplingParams(
        temperature=1.0, max_tokens=max_tokens, stop_token_ids=[newline], seed=1000 * g + i)) for i in range(group)]
        for g, p in enumerate(prompts)]


def demo_engine_round(engine, prompts, group: int, max_tokens: int, newline: int, tag: str) -> tuple[float, int]:
    """One round on the engine, each group submitted as the worker does; (seconds, tokens generated)."""
    from tidal.rollout.engines.common import submit_all

    groups = demo_requests(prompts, group, max_tokens, newline, tag)
    t0 = time.perf_counter()
    for g in groups:
        submit_all(engine, g)
    left, tokens = len(prompts) * group, 0
    while left:
        for r in engine.poll(timeout=600):
            left -= 1
            tokens += len(r.completion_ids)
    return time.perf_counter() - t0, tokens


def demo_engine_in_flight(engine, prompts, group: int, max_tokens: int, newline: int, in_flight: int,
                          tag: str) -> float:
    """All `prompts` as groups, `in_flight` of them at a time, a new group submitted as one completes."""
    from tidal.rollout.engines.common import submit_all

    groups = demo_requests(prompts, group, max_tokens, newline, tag)
    todo = iter(groups)
    left: dict[str, int] = {}
    t0 = time.perf_counter()
    for g in groups[:in_flight]:
        next(todo)
        left[g[0].request_id.split(":")[0]] = group
        submit_all(engine, g)
    while left:
        for r in engine.poll(timeout=600):
            gid = r.request_id.split(":")[0]
            left[gid] -= 1
            if not left[gid]:
                del left[gid]
                nxt = next(todo, None)
                if nxt is not None:
                    left[nxt[0].request_id.split(":")[0]] = group
                    submit_all(engine, nxt)
    return time.perf_counter() - t0


def main_demo(args) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the engine's loop thread uses the same intra-op pool
    torch.manual_seed(0)
    try:
        _demo(args)
    finally:
        torch.set_num_threads(threads)


def _demo(args) -> None:
    from transformers import AutoModelForCausalLM

    from tidal.rollout.engines.embedded import EmbeddedEngine
    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_model(f"{tmp}/model", hidden=args.hidden, layers=args.layers,
                                              intermediate=2 * args.hidden)
        tok = load_tokenizer(path)
        (newline,) = tok.encode("\n", add_special_tokens=False)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(args.device).eval()
        per_round, samples = args.groups, args.groups * args.group_size
        prompts = demo_prompts(tok, per_round * (args.reps * args.rounds + 1))
        engine = EmbeddedEngine(path, max_num_seqs=args.max_num_seqs, device=args.device)
        try:
            demo_engine_round(engine, prompts[:per_round], args.group_size, args.demo_tokens, newline, "warm")
            demo_generate(model, prompts[:per_round], args.group_size, args.demo_tokens, newline)
            reps, tokens = [], 0
            for rep in range(args.reps):  # interleaved, so machine noise hits all three alike
                chunks = [prompts[(1 + rep * args.rounds + r) * per_round:][:per_round] for r in range(args.rounds)]
                gen = sum(demo_generate(model, c, args.group_size, args.demo_tokens, newline)[0] for c in chunks)
                eng = 0.0
                for r, c in enumerate(chunks):
                    t, n = demo_engine_round(engine, c, args.group_size, args.demo_tokens, newline, f"r{rep}.{r}-")
                    eng, tokens = eng + t, tokens + n
                flight = demo_engine_in_flight(engine, [p for c in chunks for p in c], args.group_size,
                                               args.demo_tokens, newline, per_round, f"f{rep}.")
                reps.append((gen, eng, flight))
        finally:
            engine.close()
    n = samples * args.rounds  # per rep, for each of the three
    gen, eng, flight = (statistics.median(r[i] for r in reps) for i in range(3))
    per_round_ratio = sorted(r[0] / r[1] for r in reps)
    flight_ratio = sorted(r[0] / r[2] for r in reps)
    print(f"demo shape: {args.reps} x {args.rounds} rounds of {per_round} groups x {args.group_size} samples, up to "
          f"{args.demo_tokens} new tokens (mean {tokens / (n * args.reps):.2f}), stop on newline, "
          f"model {args.model or 'random tiny'}, torch {torch.__version__}, {torch.get_num_threads()} intra-op "
          f"threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'':38}{'s/round':>10}{'samples/s':>12}")
    print(f"{f'model.generate (batch of {samples})':38}{gen / args.rounds:10.4f}{n / gen:12.0f}")
    print(f"{'embedded engine, rounds':38}{eng / args.rounds:10.4f}{n / eng:12.0f}")
    print(f"{f'embedded engine, {per_round} groups in flight':38}{flight / args.rounds:10.4f}{n / flight:12.0f}")
    print(f"engine / generate: rounds {gen / eng:.2f}x ({per_round_ratio[0]:.2f}..{per_round_ratio[-1]:.2f} over "
          f"{args.reps} reps), in flight {gen / flight:.2f}x ({flight_ratio[0]:.2f}..{flight_ratio[-1]:.2f})   "
          f"(goal >= 1.5x)")
    print(json.dumps({"bench": "engine", "shape": "demo", "rounds": args.rounds, "reps": args.reps,
                      "samples_per_round": samples, "mean_tokens": tokens / (n * args.reps),
                      "generate_samples_s": n / gen, "engine_samples_s": n / eng,
                      "engine_in_flight_samples_s": n / flight, "ratio": gen / eng, "ratio_in_flight": gen / flight,
                      "ratio_range": [per_round_ratio[0], per_round_ratio[-1]],
                      "ratio_in_flight_range": [flight_ratio[0], flight_ratio[-1]]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shape", choices=["longtail", "demo", "both"], default="longtail",
                    help="longtail: the workload above; demo: the demo's rollouts (see --shape demo above)")
    ap.add_argument("--model", default="", help="demo shape: a model folder (default: a random tiny model)")
    ap.add_argument("--rounds", type=int, default=20, help="demo shape: rounds of --groups groups")
    ap.add_argument("--groups", type=int, default=8, help="demo shape: groups per round (and in flight)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--demo-tokens", type=int, default=6, help="demo shape: max new tokens (the demo's 6)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="demo shape: engine slots (the demo's 128)")
    ap.add_argument("--threads", type=int, default=1, help="demo shape: torch threads (a demo worker's 1)")
    args = ap.parse_args()
    if args.shape in ("demo", "both"):
        main_demo(args)
    if args.shape in ("longtail", "both"):
        main_longtail(args)


def main_longtail(args) -> None:
    from transformers import AutoModelForCausalLM

    from tidal.rollout.engines.embedded import EmbeddedEngine
    from tidal.rollout.tiny import build_tiny_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/model", hidden=args.hidden, layers=args.layers,
                                intermediate=2 * args.hidden, max_positions=args.prompt_len + args.max_tokens + 8)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(args.device).eval()
        lengths = stop_lengths(args.requests, args.max_tokens)
        ps = prompts(args.requests, args.prompt_len, model.config.vocab_size)
        useful = sum(lengths)
        engine = EmbeddedEngine(path, max_num_seqs=args.concurrency, device=args.device)
        try:
            run_engine(engine, ps[:4], [8] * 4, "warm")  # first-call costs out of the timing
            run_generate(model, ps[:4], [8] * 4, 4, 8)
            gen_t, eng_t = [], []
            for rep in range(args.reps):  # interleaved, so machine noise hits both alike
                gen_t.append(run_generate(model, ps, lengths, args.concurrency, args.max_tokens))
                eng_t.append(run_engine(engine, ps, lengths, f"r{rep}-"))
            pause = measure_pause(engine, model, ps[: args.concurrency])
        finally:
            engine.close()
    g, e = statistics.median(gen_t), statistics.median(eng_t)
    print(f"workload: {args.requests} requests, concurrency {args.concurrency}, stop lengths {min(lengths)}.."
          f"{max(lengths)} (mean {useful / len(lengths):.1f}), model hidden {args.hidden} x {args.layers} layers, "
          f"{threading.active_count()} threads, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print(f"{'':24}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'model.generate':24}{g:10.3f}{useful / g:12.0f}")
    print(f"{'embedded engine':24}{e:10.3f}{useful / e:12.0f}")
    print(f"engine / generate: {g / e:.2f}x   (goal >= 2x)")
    print(f"in-flight update pause: median {pause['pause_ms_median']:.2f} ms, max {pause['pause_ms_max']:.2f} ms "
          f"(goal <= 10 ms); update_weights() call returns in {pause['update_call_ms_median']:.2f} ms median "
          f"(waits for the step in progress)")
    print(json.dumps({"bench": "engine", "requests": args.requests, "concurrency": args.concurrency,
                      "generate_tok_s": useful / g, "engine_tok_s": useful / e, "ratio": g / e, **pause}))


if __name__ == "__main__":
    main()
