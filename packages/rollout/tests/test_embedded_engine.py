"""The embedded engine against plain transformers forward passes: processed logprobs, versions across
in-flight updates in every partial-rollout mode, continuous batching, seeds, masks, routing, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.core.interfaces import Engine, GenerationRequest
from tidal.core.protocol import SamplingParams
from tidal.rollout.engines.embedded import EmbeddedEngine, EngineError
from tidal.rollout.engines.logprobs import teacher_forced_logprobs
from tidal.rollout.engines.sampling import process_logits, unpack_kept_mask

pytestmark = pytest.mark.timeout(300)


def reference(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def requests(prefix, n, *, seed=0, max_tokens=(4, 60), **kw):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 70, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
        sp = SamplingParams(
            temperature=[0.7, 1.0][i % 2], top_p=[0.9, 1.0][(i // 2) % 2], top_k=[-1, 12][(i // 4) % 2],
            max_tokens=int(torch.randint(*max_tokens, (1,), generator=g)), seed=1000 + i, **kw,
        )
        out.append(GenerationRequest(request_id=f"{prefix}{i}", prompt_ids=prompt, sampling=sp))
    return out


def wait_generated(eng, n: int, timeout: float = 60.0) -> None:
    """Until the engine has generated `n` tokens (its load state says so); fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while (done := eng.load_state()["tokens_generated"]) < n:
        assert time.monotonic() < deadline, f"the engine generated {done:.0f} of {n} tokens within {timeout:g} s"
        time.sleep(0.002)


def perturbed(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return {n: p + torch.randn(p.shape, generator=g) * scale for n, p in model.state_dict().items()}


def max_diff(model, reqs, results, *, fp32_lm_head=False, positions=None):
    worst = 0.0
    for rq in reqs:
        res = results[rq.request_id]
        tf = teacher_forced_logprobs(model, rq.prompt_ids, res.completion_ids, rq.sampling, fp32_lm_head=fp32_lm_head)
        eng = torch.tensor(res.logprobs)
        sel = positions(res) if positions else slice(None)
        if len(eng[sel]):
            worst = max(worst, (tf[sel] - eng[sel]).abs().max().item())
    return worst


@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_logprobs_equal_a_teacher_forced_forward_pass(tiny_model, fp32_lm_head):
    model = reference(tiny_model)
    reqs = requests("r", 32)
    with EmbeddedEngine(tiny_model, max_num_seqs=8, fp32_lm_head=fp32_lm_head) as eng:
        assert isinstance(eng, Engine)
        results = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
        stats = eng.load_state()
    assert set(results) == {r.request_id for r in reqs}
    for rq in reqs:
        res = results[rq.request_id]
        n = len(res.completion_ids)
        assert len(res.logprobs) == len(res.versions) == n >= 1 and res.versions == [0] * n
        assert res.finish_reason in ("stop", "length")
        assert res.finish_reason == "stop" or n == rq.sampling.max_tokens
    worst = max_diff(model, reqs, results, fp32_lm_head=fp32_lm_head)
    assert worst <= 1e-5, worst
    # continuous batching: 32 requests through 8 slots, joining as others leave
    assert stats["finished"] == 32 and stats["decode_steps"] > 0


def test_processed_distribution_is_what_the_sampler_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 3)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(top_p=0.7), SamplingParams(temperature=0.0)]
    lp = process_logits(logits, params)
    assert torch.isfinite(lp[0]).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits[1], -1)  # 0.55, 0.20, ...: 0.55 < 0.7 so the second is kept too
    assert p[0] < 0.7 < p[0] + p[1] and torch.isfinite(lp[1]).tolist() == [True, True, False, False, False]
    assert torch.allclose(lp[0].exp().sum(), torch.tensor(1.0)) and lp[2, 0] == 0.0  # greedy: point mass
    with pytest.raises(ValueError, match="logits"):
        process_logits(logits, params[:1])


def test_seeded_requests_are_reproducible_whatever_else_runs(tiny_model):
    reqs = requests("s", 6)
    with EmbeddedEngine(tiny_model, max_num_seqs=3) as eng:
        alone = {r.request_id: r.completion_ids for r in eng.generate(reqs, timeout=60)}
        crowd = requests("other", 10, seed=5)
        together = {r.request_id: r.completion_ids for r in eng.generate([*crowd, *reqs], timeout=60)}
    assert all(alone[k] == together[k] for k in alone)


def assert_kv_versions(mode, versions, kv_versions):
    """Per token, the oldest version in the KV cache it attended to: in "continue" mode the prompt's KV
    (written at version 0) stays under the tokens sampled after the update; recompute and retry rebuild it."""
    assert kv_versions is not None and len(kv_versions) == len(versions)
    if mode == "continue":
        assert set(kv_versions) == {0}
        assert 1 in versions  # tokens sampled by version 1 over version 0's KV
    else:
        assert kv_versions == versions


@pytest.mark.parametrize("mode", ["continue", "recompute", "retry", "drop"])
def test_in_flight_update_in_each_partial_rollout_mode(tiny_model, mode):
    model = reference(tiny_model)
    new_state = perturbed(model)
    new_model = reference(tiny_model)
    new_model.load_state_dict(new_state)
    reqs = requests("u", 8, max_tokens=(150, 200), ignore_eos=True)
    with EmbeddedEngine(tiny_model, max_num_seqs=8, partial_mode=mode) as eng:
        for r in reqs:
            eng.submit(r)
        wait_generated(eng, 8 * 10)  # everything is mid-sequence
        eng.update_weights(new_state.items(), version=1)
        assert eng.version == 1 and eng.stats["last_update_pause_s"] < 1.0
        results = {}
        while len(results) < len(reqs):
            results.update((r.request_id, r) for r in eng.poll(timeout=60))
        later = requests("v", 4, seed=9)
        after = {r.request_id: r for r in eng.generate(later, timeout=60)}
    assert max_diff(new_model, later, after) <= 1e-5  # requests after the update: exactly the new weights
    assert all(r.versions == [1] * len(r.versions) for r in after.values())
    assert all(r.kv_versions == r.versions for r in after.values())  # no update in flight: KV as new as the token
    for rq in reqs:
        res = results[rq.request_id]
        v = res.versions
        assert v == sorted(v)
        assert_kv_versions(mode, v, res.kv_versions)
        if mode == "drop":
            assert res.finish_reason == "abort" and set(v) == {0}
            continue
        assert res.finish_reason == "length" and len(res.completion_ids) == rq.sampling.max_tokens
        if mode == "retry":
            assert set(v) == {1}
            assert max_diff(new_model, [rq], results) <= 1e-5
        else:
            assert 0 in v and 1 in v
            first_new = v.index(1)
            if mode == "recompute":  # tokens after the update are exactly the new weights' (KV rebuilt)
                assert max_diff(new_model, [rq], results, positions=lambda r, k=first_new: slice(k, None)) <= 1e-5
            # tokens before the update are exactly the old weights'
            assert max_diff(model, [rq], results, positions=lambda r, k=first_new: slice(0, k)) <= 1e-5


def test_update_pause_is_short_and_bad_updates_keep_the_old_weights(tiny_model):
    model = reference(tiny_model)
    with EmbeddedEngine(tiny_model, max_num_seqs=4) as eng:
        with pytest.raises(EngineError, match="unknown names"):
            eng.update_weights([("no.such.weight", torch.zeros(3))], version=1)
        with pytest.raises(EngineError, match="wrong shapes"):
            eng.update_weights([("lm_head.weight", torch.zeros(3, 3))], version=1)
        assert eng.version == 0
        reqs = requests("k", 4)
        res = {r.request_id: r for r in eng.generate(reqs, timeout=60)}
        assert max_diff(model, reqs, res) <= 1e-5  # still the original weights


def test_pause_resume_and_abort(tiny_model):
    with EmbeddedEngine(tiny_model, max_num_seqs=4) as eng:
        eng.pause()
        reqs = requests("p", 3, max_tokens=(100, 101), ignore_eos=True)
        for r in reqs:
            eng.submit(r)
        assert eng.poll(timeout=0.3) == [] and eng.load_state()["tokens_generated"] == 0
        eng.resume()
        wait_generated(eng, 6)
        eng.abort(["p0", "nope"])
        got = {}
        while len(got) < 3:
            got.update((r.request_id, r) for r in eng.poll(timeout=30))
    assert got["p0"].finish_reason == "abort" and len(got["p0"].completion_ids) < 100
    assert got["p1"].finish_reason == got["p2"].finish_reason == "length"


def test_sampling_mask_and_routing_are_recorded(tiny_moe):
    model = reference(tiny_moe)
    reqs = requests("m", 4, return_sampling_mask=True, return_routing=True)
    with EmbeddedEngine(tiny_moe, max_num_seqs=4) as eng:
        results = {r.request_id: r for r in eng.generate(reqs, timeout=60)}
    assert max_diff(model, reqs, results) <= 1e-5
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for rq in reqs:
        res = results[rq.request_id]
        n = len(res.completion_ids)
        # the mask is the support the sampler used: the drawn token is in it, and it matches top-k/top-p
        kept = unpack_kept_mask(res.sampling_mask, model.config.vocab_size)
        assert kept.shape == (n, model.config.vocab_size) and all(kept[i, t] for i, t in enumerate(res.completion_ids))
        if rq.sampling.top_k > 0:
            assert (kept.sum(1) >= rq.sampling.top_k).all() and (kept.sum(1) < model.config.vocab_size).all()
        # routing: the experts the router picked at the position that produced each token
        assert res.routing.shape == (n, layers, k)
        ids = torch.tensor([rq.prompt_ids + res.completion_ids[:-1]])
        routes: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, a, out, acc=routes: acc.append(out[2])) for m in model.modules()
                 if type(m).__name__.endswith("Router")]
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        want = torch.stack(routes, 1)[len(rq.prompt_ids) - 1 :].numpy()
        assert np.array_equal(np.sort(res.routing, -1), np.sort(want, -1))


def test_bad_requests_and_models_get_clear_errors(tiny_model, tmp_path):
    with pytest.raises(EngineError, match="no model at"):
        EmbeddedEngine(tmp_path / "missing")
    with pytest.raises(EngineError, match="partial_mode"):
        EmbeddedEngine(tiny_model, partial_mode="sometimes")
    with EmbeddedEngine(tiny_model) as eng:
        with pytest.raises(EngineError, match="empty prompt"):
            eng.submit(GenerationRequest(request_id="e", prompt_ids=[]))
        with pytest.raises(EngineError, match="outside the vocabulary"):
            eng.submit(GenerationRequest(request_id="e", prompt_ids=[1, 10_000]))
        with pytest.raises(EngineError, match="top_p"):
            eng.submit(GenerationRequest(request_id="e", prompt_ids=[5], sampling=SamplingParams(top_p=0.0)))
        with pytest.raises(EngineError, match="no router"):
            eng.submit(GenerationRequest(request_id="e", prompt_ids=[5], sampling=SamplingParams(return_routing=True)))


def test_updates_from_another_thread_while_generating(tiny_model):
    """The worker applies updates from its weight thread while the loop runs: no lost or torn steps."""
    model = reference(tiny_model)
    states = [perturbed(model, 0.02, seed=s) for s in range(5)]
    reqs = requests("t", 16, max_tokens=(60, 120), ignore_eos=True)
    with EmbeddedEngine(tiny_model, max_num_seqs=16) as eng:
        for r in reqs:
            eng.submit(r)

        def updater():
            for v, st in enumerate(states, start=1):
                eng.update_weights(st.items(), version=v)
                time.sleep(0.01)

        t = threading.Thread(target=updater)
        t.start()
        results = {}
        while len(results) < len(reqs):
            results.update((r.request_id, r) for r in eng.poll(timeout=60))
        t.join()
    assert eng.version == 5
    for res in results.values():
        assert res.versions == sorted(res.versions) and len(res.completion_ids) == len(res.versions)


def groups_of(prefix, prompts, size, **kw):
    return [GenerationRequest(request_id=f"{prefix}{g}:{i}", prompt_ids=p,
                              sampling=SamplingParams(max_tokens=12, seed=100 * g + i, **kw))
            for g, p in enumerate(prompts) for i in range(size)]


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_moe"])
def test_a_groups_shared_prompt_is_prefilled_once_with_the_same_samples(fixture, request):
    """Samples of one prompt submitted together share one prefill (keys/values copied to their rows):
    same seeds give the same tokens as separate prefills, logprobs equal to 1e-5 and to a teacher-forced
    pass, and routing of the prompt positions is the leader's."""
    path = request.getfixturevalue(fixture)
    moe = fixture == "tiny_moe"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 70, (n,), generator=g).tolist() for n in (5, 5, 9, 1)]  # two of one length
    extra = dict(return_routing=True, return_sampling_mask=True, top_k=20) if moe else {}
    reqs = groups_of("g", prompts, 4, **extra)
    out = {}
    for share in (False, True):
        with EmbeddedEngine(path, max_num_seqs=16, share_prompts=share) as eng:
            eng.submit_many(reqs)
            got = {}
            while len(got) < len(reqs):
                got.update((r.request_id, r) for r in eng.poll(timeout=60))
            out[share] = (got, eng.load_state())
    (sep, sep_stats), (shared, shared_stats) = out[False], out[True]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    # the 1-token prompt is a decode either way; the others feed their prompt once per group, not per sample
    assert sep_stats["tokens_fed"] - shared_stats["tokens_fed"] == 3 * (5 + 5 + 9)
    assert sep_stats["tokens_fed"] >= prompt_tokens
    for rq in reqs:
        a, b = sep[rq.request_id], shared[rq.request_id]
        assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        if moe:
            assert np.array_equal(a.sampling_mask, b.sampling_mask)
            assert np.array_equal(np.sort(a.routing, -1), np.sort(b.routing, -1))
    assert max_diff(reference(path), reqs, shared) <= 1e-5


def test_many_sequences_leaving_at_once_keep_the_others_intact(tiny_model):
    """Rows freed by several sequences finishing in one step are refilled in one move; the survivors'
    caches stay theirs (their logprobs still equal a teacher-forced pass)."""
    short = groups_of("s", [[5, 6, 7]] * 3, 3)
    short = [msgspec_replace(r, max_tokens=2, ignore_eos=True) for r in short]
    long = requests("l", 6, max_tokens=(20, 30), ignore_eos=True)
    reqs = [*short, *long]
    with EmbeddedEngine(tiny_model, max_num_seqs=16) as eng:
        eng.submit_many(reqs)
        got = {}
        while len(got) < len(reqs):
            got.update((r.request_id, r) for r in eng.poll(timeout=60))
        assert eng.load_state()["running"] == 0
    assert all(len(got[r.request_id].completion_ids) == 2 for r in short)
    assert max_diff(reference(tiny_model), reqs, got) <= 1e-5


def msgspec_replace(req, **sampling):
    import msgspec

    return GenerationRequest(request_id=req.request_id, prompt_ids=req.prompt_ids,
                             sampling=msgspec.structs.replace(req.sampling, **sampling))


def test_result_forwarder_hands_over_results_wakes_the_poll_and_reports_a_closed_engine(tiny_model):
    """The worker loop's view of an engine: results arrive through `take()` and each batch of them wakes
    a `poll` on the loop's sockets; an engine that stops is raised from `take()`, not swallowed."""
    from tidal.core.channels import Waker, poll, pull
    from tidal.rollout.worker.results import ResultForwarder

    engine = EmbeddedEngine(tiny_model)
    waker = Waker()
    fwd = ResultForwarder(engine, waker, wait_s=0.05)
    fwd.start()
    try:
        reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3))
                for i in range(4)]
        for r in reqs:
            engine.submit(r)
        got: list = []
        deadline = time.monotonic() + 60
        with pull("tcp://127.0.0.1:*") as idle:  # a socket with nothing on it: only the waker ends the poll
            while len(got) < len(reqs) and time.monotonic() < deadline:
                poll([idle], timeout=30, waker=waker)
                got += fwd.take()
        assert sorted(r.request_id for r in got) == [r.request_id for r in reqs]
        engine.close()
        deadline = time.monotonic() + 10
        with pytest.raises(EngineError, match="closed"):
            while time.monotonic() < deadline:
                fwd.take()
                time.sleep(0.02)
    finally:
        fwd.close()
        engine.close()
        waker.close()
