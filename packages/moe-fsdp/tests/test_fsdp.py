"""A tiny Mixtral under FSDP2 on a ("dp", "ep") mesh of 2 gloo ranks trains 3 AdamW steps, and the weights
gathered shard by shard equal those of one process training the same model on the same batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_tiny import STEPS, batch, lm_loss, optimizer, run_ranks, tiny_mixtral

from tidal.moe_fsdp import convert_hf_moe

HERE = Path(__file__).parent
TOL = 1e-5  # fp32, 3 AdamW steps at lr 1e-2 (a weight moves by ~3e-2); measured max |diff| is printed


def reference() -> tuple[dict[str, torch.Tensor], list[list[float]], dict[str, torch.Tensor]]:
    """One process: the same model, each step the mean of the two ranks' losses, each on its own batch."""
    model = tiny_mixtral()
    convert_hf_moe(model)
    opt = optimizer(model)
    losses, first_grads = [], {}
    for step in range(STEPS):
        per_rank = [lm_loss(model, batch(step, r)) for r in (0, 1)]
        (sum(per_rank) / 2).backward()
        if step == 0:
            first_grads = {k: v.grad.clone() for k, v in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append([v.item() for v in per_rank])
    return {k: v.detach() for k, v in model.named_parameters()}, losses, first_grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(HERE / "fsdp_rank.py", str(out), "2", "1", timeout=280)
    return out, reference()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [2, 1], ids=["dp1xep2", "dp2xep1"])
def test_fsdp2_moe_model_trains_and_gathers_the_reference_weights(ep, runs):
    out, (want, ref_losses, ref_grads) = runs
    got = torch.load(out / f"fsdp_ep{ep}.pt")
    hf_names = {k for k, _ in tiny_mixtral().named_parameters()}
    assert set(got["weights"]) == set(want) == hf_names  # the Hugging Face names, every parameter
    initial = dict(tiny_mixtral().named_parameters())
    diff = {k: (got["weights"][k] - want[k]).abs().max().item() for k in want}
    worst = max(diff, key=diff.get)
    moved = max((want[k] - initial[k]).abs().max().item() for k in want)
    print(f"\nFSDP2 ep={ep}: max |gathered - reference| = {diff[worst]:.2e} ({worst}); weights moved up to "
          f"{moved:.2e}; rank-0 losses {[round(v, 4) for v in got['losses']]}")
    grad_diff = max((got["grads"][k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    print(f"FSDP2 ep={ep}: step-1 reduced gradients max |diff| = {grad_diff:.2e}")
    assert diff[worst] <= TOL, (worst, diff[worst])
    assert grad_diff <= TOL  # experts' gradients are averaged over dp × ep, like the dense ones
    assert moved > 1e-3  # it really trained
    assert got["losses"] == pytest.approx([r[0] for r in ref_losses], abs=1e-5)
