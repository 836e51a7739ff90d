"""Experts split over 2 gloo ranks give the outputs and gradients of one process holding them all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_tiny import EP_CASES, block_loss, full_block, rank_inputs, run_ranks

HERE = Path(__file__).parent
TOL = 1e-5  # of max(1, the reference's largest entry): the GPT-OSS cases' clamped values reach ~50


def diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    run_ranks(HERE / "ep_rank.py", str(out))
    return [torch.load(out / f"ep_rank{r}.pt") for r in (0, 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", EP_CASES, ids=[c[0] for c in EP_CASES])
def test_ep2_outputs_and_gradients_equal_one_process(case, ep_results):
    name, overrides, force = case
    from moe_tiny import block_config

    ref = full_block(block_config(**overrides))  # all 4 experts, no process group
    diffs = {}
    for rank in (0, 1):
        got = ep_results[rank][name]
        x, g, routes = rank_inputs(rank, force)
        x.requires_grad_()
        ref.force_routes(routes)
        loss, y = block_loss(ref, x, g)
        loss.backward()  # the reference's weight grads accumulate over both ranks' losses
        diffs[f"y{rank}"] = diff(got["y"], y.detach())
        diffs[f"x_grad{rank}"] = diff(got["x_grad"], x.grad)
        assert torch.equal(got["routes"], ref.routes)
    # a replicated router sums its ranks' gradients; each rank's experts are a slice of the full ones
    for pname, param in ref.named_parameters():
        parts = [ep_results[r][name]["grads"][pname] for r in (0, 1)]
        full = torch.cat(parts) if pname.startswith("experts.") else parts[0] + parts[1]
        assert full.shape == param.shape
        diffs[pname] = diff(full, param.grad)
    print(f"\nEP=2 {name}: max |diff| / max(1, |ref|) " + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) <= TOL, diffs
    assert ref.top_k_router.weight.grad.abs().max() > 0 and ref.experts.down_proj.grad.abs().max() > 0
    if force:  # expert 3 received no token on either rank: its gradients are exactly zero, not missing
        assert torch.count_nonzero(torch.cat([ep_results[r][name]["grads"]["experts.down_proj"] for r in (0, 1)])[3]) == 0
