"""NaN safety (issue 33): every correction's weights are finite on extreme inputs (log-ratios of +-1000,
-inf behaviour logprobs at masked positions, an empty row), and 0 on a batch without valid tokens."""

from __future__ import annotations

import pytest
import torch

from tidal.staleness.correction import FACTORIES, CorrectionInputs

INF = torch.inf


def extreme(all_masked: bool = False) -> CorrectionInputs:
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]]) & (not all_masked)
    learner = torch.full((3, 3), -1.0)
    behaviour = learner + torch.tensor([[-1000.0, 1000.0, 0.1], [0.2, -INF, -INF], [-INF] * 3])
    return CorrectionInputs(learner_logprobs=learner, behaviour_logprobs=behaviour, mask=mask,
                            advantages=torch.tensor([[-1.0] * 3, [1.0, torch.nan, torch.nan], [torch.nan] * 3]),
                            proximal_logprobs=learner - 0.1)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_extreme_ratios_give_finite_weights(name):
    cls, cfg = FACTORIES[name]
    policy = cls(**{f: getattr(cfg(), f) for f in cfg.__struct_fields__})
    inp = extreme()
    out = policy(inp)
    assert torch.isfinite(out.weights).all(), (name, out.weights)
    assert (out.weights[~inp.mask] == 0).all() and not out.mask[~inp.mask].any(), name
    assert all(torch.isfinite(v) for v in out.metrics.values()), (name, out.metrics)
    empty = policy(extreme(all_masked=True))
    assert (empty.weights == 0).all() and not empty.mask.any(), name
