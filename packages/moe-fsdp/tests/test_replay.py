"""Routing replay: routes recorded the way tidal-rollout records them are used exactly; different routes
change the output and still train the router; mismatch statistics count differing expert sets."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from moe_tiny import tiny_mixtral

from tidal.moe_fsdp import (
    convert_hf_moe,
    moe_blocks,
    replay_routing,
    router_routes,
    routes_for_sequence,
    routing_mismatch,
    used_routes,
)

IDS = torch.randint(0, 48, (1, 12), generator=torch.Generator().manual_seed(3))


def _record_like_rollout(hf) -> tuple[np.ndarray, torch.Tensor]:
    """Hooks on every *Router module (as tidal-rollout's embedded engine does): int16 [T, L, k]."""
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen.append(out[2].detach()))
             for m in hf.modules() if type(m).__name__.endswith("Router")]
    with torch.no_grad():
        logits = hf(input_ids=IDS).logits
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1).numpy().astype(np.int16), logits


@pytest.fixture
def models():
    hf = tiny_mixtral()
    mine = copy.deepcopy(hf)
    convert_hf_moe(mine)
    return hf, mine


def test_replayed_rollout_routes_are_used_exactly_and_reproduce_the_sampler(models):
    hf, mine = models
    routing, hf_logits = _record_like_rollout(hf)
    assert routing.shape == (12, 2, 2) and routing.dtype == np.int16
    with replay_routing(mine, routing):
        logits = mine(input_ids=IDS).logits
    assert torch.equal(used_routes(mine), torch.from_numpy(routing).long())
    assert (logits - hf_logits).abs().max() <= 1e-5
    assert routing_mismatch(routing, router_routes(mine)).tolist() == [0.0, 0.0]
    assert all(b._forced is None for b in moe_blocks(mine))  # replay ends with the block


def test_replaying_other_routes_changes_the_output_and_still_trains_the_router(models):
    _, mine = models
    with torch.no_grad():
        free = mine(input_ids=IDS).logits
    chosen = used_routes(mine)
    altered = chosen.clone()
    tokens = [0, 4, 5, 9]
    for t in tokens:  # layer 0: send these tokens to the two experts the router ranked last
        altered[t, 0] = torch.tensor([e for e in range(4) if e not in chosen[t, 0].tolist()])
    with replay_routing(mine, altered):
        out = mine(input_ids=IDS, labels=IDS)
    assert torch.equal(used_routes(mine), altered)
    assert (out.logits - free).abs().max() > 1e-4
    mismatch = routing_mismatch(altered, router_routes(mine))
    assert mismatch[0].item() == pytest.approx(len(tokens) / 12)
    out.loss.backward()
    router = moe_blocks(mine)[0].gate.weight.grad
    assert router is not None and torch.isfinite(router).all() and router.abs().max() > 0


def test_unrecorded_rows_are_routed_by_the_router(models):
    _, mine = models
    with torch.no_grad():
        mine(input_ids=IDS)
    chosen = used_routes(mine)
    completion = torch.tensor([[[3, 2], [1, 0]]] * 4)  # 4 completion tokens, 2 layers, top-2
    routing = routes_for_sequence(completion, prompt_len=8, seq_len=12)
    assert (routing[:7] == -1).all() and torch.equal(routing[7:11], completion) and (routing[11] == -1).all()
    with replay_routing(mine, routing), torch.no_grad():
        mine(input_ids=IDS)
    used = used_routes(mine)
    assert torch.equal(used[7:11], completion)
    assert torch.equal(used[:7, 0], chosen[:7, 0])  # layer 0 before any forced token: the router's choice
    assert torch.equal(used[:, 1][routing[:, 1, 0] < 0], router_routes(mine)[:, 1][routing[:, 1, 0] < 0])


def test_routing_of_the_wrong_layout_is_refused_with_the_expected_shape(models):
    _, mine = models
    with pytest.raises(ValueError, match=r"\[tokens, 2 layers, top_k\]"):
        with replay_routing(mine, np.zeros((12, 3, 2), dtype=np.int16)):
            pass
