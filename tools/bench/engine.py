"""The embedded engine against plain `model.generate` on the same model, in one run.

    uv run python tools/bench/engine.py [--requests 256] [--concurrency 64] [--max-tokens 128]
                                        [--hidden 128 --layers 2] [--reps 3]

Workload: `--requests` prompts of 16 tokens, each with its own stop length drawn from a long tail (most
short, a few at `--max-tokens`), sampled at temperature 1. `model.generate` runs them in batches of
`--concurrency` (the same prompt length, so no prompt padding) and each batch runs until its longest
row stops, with per-row stopping criteria; the engine keeps `--concurrency` sequences in flight and
lets each one leave when it stops. Tokens/s counts only the tokens each request asked for, for both.

Also measured: the pause an in-flight weight update causes — the time the engine's loop is stopped
while the new tensors are copied in (`last_update_pause_s`), with all sequences mid-generation.

Prints a table and one JSON line. Goal: engine / generate >= 2x; update pause <= 10 ms on a tiny model.
"""

from __future__ import annotations

import argparse
import json
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
    args = ap.parse_args()

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
