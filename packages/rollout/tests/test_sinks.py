"""GPT-OSS-style attention sinks in the embedded engine: its `tidal_packed` attention gives the logprobs
of transformers' own (eager) GPT-OSS forward, through every attention path the engine takes (batched
fresh prefills of a group's shared prompt, single prefills, decodes of uneven context lengths joined
mid-run), and records the routing transformers' router picks. A negative control shows that dropping
the sinks would fail the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import SamplingParams
from tidal.rollout.engines.attention import _sdpa
from tidal.rollout.engines.embedded import EmbeddedEngine
from tidal.rollout.engines.logprobs import teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)


def oss_requests(n: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(n):
        if i % 3 == 0:  # groups of three share a prompt (one batched prefill); lengths differ by group
            prompt = torch.randint(3, 70, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
        sp = SamplingParams(temperature=[0.7, 1.0][i % 2], top_p=[0.9, 1.0][(i // 2) % 2], max_tokens=int(
            torch.randint(4, 30, (1,), generator=g)), seed=500 + i, return_routing=True, ignore_eos=True)
        out.append(GenerationRequest(request_id=f"s{i}", prompt_ids=prompt, sampling=sp))
    return out


def worst_diff(model, reqs, results) -> float:
    worst = 0.0
    for rq in reqs:
        res = results[rq.request_id]
        tf = teacher_forced_logprobs(model, rq.prompt_ids, res.completion_ids, rq.sampling)
        worst = max(worst, (tf - torch.tensor(res.logprobs)).abs().max().item())
    return worst


def test_sink_logprobs_and_routing_equal_transformers_gpt_oss_forward(tiny_oss):
    model = AutoModelForCausalLM.from_pretrained(tiny_oss).eval()  # GPT-OSS: transformers' eager attention
    assert model.config.model_type == "gpt_oss" and model.config._attn_implementation == "eager"
    assert all(layer.self_attn.sinks.abs().max() > 0.3 for layer in model.model.layers)  # sinks that matter
    reqs = oss_requests(18)
    with EmbeddedEngine(tiny_oss, max_num_seqs=6) as eng:  # 18 through 6 slots: joins while others decode
        results = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
        stats = eng.load_state()
    assert stats["decode_steps"] > 0 and stats["prefill_steps"] > 1
    assert worst_diff(model, reqs, results) <= 1e-5
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for rq in reqs[:6]:
        res = results[rq.request_id]
        routes: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, a, out, acc=routes: acc.append(out[2])) for m in model.modules()
                 if type(m).__name__.endswith("Router")]
        with torch.no_grad():
            model(torch.tensor([rq.prompt_ids + res.completion_ids[:-1]]))
        for h in hooks:
            h.remove()
        want = torch.stack(routes, 1)[len(rq.prompt_ids) - 1 :].numpy()
        assert res.routing.shape == (len(res.completion_ids), layers, k)
        assert np.array_equal(np.sort(res.routing, -1), np.sort(want, -1))
    # negative control: the same model without sinks (logit -inf) is far from what the engine sampled with
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
    assert worst_diff(model, reqs, results) > 1e-2


@pytest.mark.parametrize("gqa", [False, True])
def test_sink_attention_equals_softmax_with_a_sink_column(gqa):
    """Each mask kind the engine passes (causal, prefix-plus-causal for a prefill over a cache, per-row
    decode masks) against the eager formula softmax([scores, sink])[:-1] @ V."""
    torch.manual_seed(0)
    b, h, hkv, m, n, d = 3, 4, 2 if gqa else 4, 5, 9, 8
    q, sinks = torch.randn(b, h, m, d), torch.randn(h)
    k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    pos = (n - m) + torch.arange(m)
    prefix_causal = (torch.arange(n)[None, :] <= pos[:, None])[None, None]  # [1, 1, m, n]
    per_row = torch.rand(b, 1, 1, n) < 0.7
    per_row[..., 0] = True
    for kw, mask in (({"causal": True}, prefix_causal), ({"mask": prefix_causal}, prefix_causal),
                     ({"mask": per_row}, per_row.expand(b, 1, m, n))):
        got = _sdpa(q, k, v, scale=d ** -0.5, gqa=gqa, sinks=sinks, **kw)
        kk, vv = (x.repeat_interleave(h // hkv, 1) for x in (k, v))
        s = (q @ kk.transpose(-1, -2)) * d ** -0.5
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.cat([s, sinks[None, :, None, None].expand(b, h, m, 1)], -1).softmax(-1)[..., :-1]
        assert (got - p @ vv).abs().max() <= 1e-6
