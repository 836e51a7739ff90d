"""The MoE block on one process: equal to the dense every-expert-on-every-token formula, to Hugging
Face's Mixtral block after conversion, and its pieces (dispatch, losses, errors) do what they say."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from moe_tiny import tiny_mixtral

from tidal.moe_fsdp import (
    MoEBlock,
    MoEConfig,
    convert_hf_moe,
    dense_moe,
    load_balancing_loss,
    router_z_loss,
    sort_by_expert,
)

TOL = 1e-5


def _dense_reference(x, router_w, gate_up, down, cfg: MoEConfig):
    """Routing and experts written plainly, differentiated by autograd."""
    logits = x @ router_w.T
    probs = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
    top, ids = probs.topk(cfg.top_k, dim=-1)
    if cfg.normalize:
        top = top / top.sum(-1, keepdim=True)
    return dense_moe(x, ids, top, gate_up, down)


@pytest.mark.parametrize("score,normalize,recompute", [
    ("softmax", True, False), ("softmax", True, True), ("softmax", False, True), ("sigmoid", False, False),
    ("sigmoid", True, True),
])
def test_lean_block_equals_dense_reference_in_outputs_and_all_gradients(score, normalize, recompute):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=12, intermediate_size=20, num_experts=6, top_k=2, score=score,
                    normalize=normalize, recompute=recompute)
    block = MoEBlock(cfg)
    x = torch.randn(3, 9, 12, requires_grad=True)
    g = torch.randn(3, 9, 12)
    (block(x) * g).sum().backward()
    params = [p.detach().clone().requires_grad_() for p in
              (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)]
    xr = x.detach().clone().requires_grad_()
    y_ref = _dense_reference(xr.reshape(-1, 12), *params, cfg)
    (y_ref * g.reshape(-1, 12)).sum().backward()
    y = block(x).detach().reshape(-1, 12)
    assert (y - y_ref).abs().max() <= TOL
    assert (x.grad - xr.grad).abs().max() <= TOL
    for mine, ref in zip((block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj), params, strict=True):
        assert (mine.grad - ref.grad).abs().max() <= TOL
        assert ref.grad.abs().max() > 0


def test_sort_by_expert_groups_slots_by_expert_and_keeps_token_order():
    ids = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2]])
    order, counts = sort_by_expert(ids, num_experts=5)
    assert counts.tolist() == [3, 0, 3, 2, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 2, 2, 2, 3, 3]
    assert (order // 2).tolist() == [0, 1, 3, 0, 2, 3, 1, 2]  # tokens ascending within each expert


def test_load_balancing_loss_is_one_for_uniform_routing_and_matches_the_mixtral_formula():
    e, k = 4, 2
    uniform = torch.full((8, e), 1 / e)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(uniform, ids, e).item() == pytest.approx(1.0)
    probs = torch.randn(8, e).softmax(-1)
    ids = probs.topk(k).indices
    mixtral = (F.one_hot(ids, e).float().mean(0) * probs.mean(0)).sum() * e  # HF's, over [T, k, E]
    assert load_balancing_loss(probs, ids, e).item() == pytest.approx(mixtral.item() / k, rel=1e-6)


def test_router_z_loss_is_mean_squared_logsumexp():
    logits = torch.randn(5, 4)
    assert router_z_loss(logits).item() == pytest.approx((logits.logsumexp(-1) ** 2).mean().item(), rel=1e-6)


def test_bad_config_and_bad_replay_shapes_say_what_to_do():
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        MoEConfig(hidden_size=4, intermediate_size=4, num_experts=4, top_k=5)
    block = MoEBlock(MoEConfig(hidden_size=4, intermediate_size=4, num_experts=4, top_k=2))
    block.force_routes(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens=5, top_k=2"):
        block(torch.randn(5, 4))
    block.force_routes(torch.full((5, 2), 7))
    with pytest.raises(ValueError, match="expert id 7 is out of range for 4"):
        block(torch.randn(5, 4))


@pytest.mark.parametrize("recompute", [False, True])
def test_converted_mixtral_equals_hugging_face_in_logits_and_gradients(recompute):
    hf = tiny_mixtral()
    mine = copy.deepcopy(hf)
    replaced = convert_hf_moe(mine, recompute=recompute)
    assert replaced == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(5))
    out_hf, out_mine = hf(input_ids=ids, labels=ids), mine(input_ids=ids, labels=ids)
    assert (out_hf.logits - out_mine.logits).abs().max() <= TOL
    out_hf.loss.backward()
    out_mine.loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in mine.named_parameters():  # same names, same layouts
        assert (p.grad - theirs[name].grad).abs().max() <= TOL, name
