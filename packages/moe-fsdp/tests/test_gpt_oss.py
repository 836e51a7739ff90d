"""GPT-OSS's expert layout in `MoEBlock`: converted from transformers' `GptOssMLP`, the block computes
transformers' output and the same gradients for the input and every parameter (router weight and bias,
interleaved gate/up with bias, down with bias), with the SwiGLU clamps active; under routing replay of the
router's own choice nothing changes; parameter names are transformers' own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.moe_fsdp import MoEBlock, convert_hf_moe, replay_routing, used_routes

pytest.importorskip("transformers")
# fp32, relative to the largest entry of the reference tensor: the same ops in the same order per expert;
# the router renormalises softmax(all logits) at the top k where transformers takes softmax(top-k
# logits) (equal in exact arithmetic), and the combine sums k products in another order than
# transformers' index_add_: rounding of ~1e-7 relative, amplified by the clamped SwiGLU's large values
TOL = 1e-6  # measured <= 2e-7


def hf_mlp(experts_impl: str):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    cfg._experts_implementation = experts_impl
    torch.manual_seed(0)
    mlp = GptOssMLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.6)  # large enough that gate > limit and |up| > limit for some entries
    return mlp


@pytest.mark.parametrize("experts_impl", ["eager", "grouped_mm"])
def test_gpt_oss_block_matches_transformers_outputs_and_gradients(experts_impl):
    mlp = hf_mlp(experts_impl)
    holder = nn.ModuleDict({"mlp": mlp})
    ours = nn.ModuleDict({"mlp": hf_mlp(experts_impl)})
    assert convert_hf_moe(ours) == ["mlp"]
    block = ours["mlp"]
    assert isinstance(block, MoEBlock) and block.config.layout == "gpt_oss" and block.config.top_k == 2
    assert {n for n, _ in block.named_parameters()} == {n for n, _ in mlp.named_parameters()}
    x = torch.randn(3, 7, 16) * 2
    with torch.no_grad():
        pre = torch.einsum("th,ehf->etf", x.reshape(-1, 16), mlp.experts.gate_up_proj)
        assert (pre[..., ::2] > mlp.experts.limit).any() and (pre[..., 1::2].abs() > mlp.experts.limit).any()
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, scores_ref = holder["mlp"](x_ref)
    y, scores = block(x_ours)  # the pair transformers' decoder layer unpacks
    g = torch.randn_like(y)
    (y_ref * g).sum().backward()
    (y * g).sum().backward()
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    diffs = {"y": rel(y, y_ref), "x": rel(x_ours.grad, x_ref.grad), "scores": rel(scores, scores_ref)}
    theirs = dict(mlp.named_parameters())
    for name, p in block.named_parameters():
        assert p.shape == theirs[name].shape and theirs[name].grad is not None
        diffs[name] = rel(p.grad, theirs[name].grad)
    print(f"\nGPT-OSS ({experts_impl}) vs transformers, max relative diff: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
    assert max(diffs.values()) <= TOL, diffs
    assert y_ref.abs().max() > 1.0  # not a comparison of zeros

    # replaying the router's own choice changes nothing
    routes = used_routes(ours).clone()
    with replay_routing(ours, routes), torch.no_grad():
        assert torch.equal(block(x)[0], y.detach())


def test_gpt_oss_recompute_gives_the_same_gradients():
    a, b = (nn.ModuleDict({"mlp": hf_mlp("eager")}) for _ in range(2))
    convert_hf_moe(a)
    convert_hf_moe(b, recompute=True)
    x = torch.randn(2, 5, 16)
    for m in (a, b):
        m["mlp"](x)[0].square().sum().backward()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0), name
