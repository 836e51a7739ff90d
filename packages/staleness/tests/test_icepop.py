"""IcePop against hand-computed weights and masks; NaN safety at masked positions; and the
geometric-mean sequence rejection (MaskedIS level "sequence") worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.staleness import CorrectionInputs, IcePop, MaskedIS, TokenTIS, combine

t = torch.tensor


def inp_from_ratios(ratios, mask=None):
    r = t(ratios, dtype=torch.float64)
    behaviour = torch.full_like(r, -1.0)
    mask = torch.ones_like(r, dtype=torch.bool) if mask is None else t(mask).bool()
    return CorrectionInputs(learner_logprobs=behaviour + r.log(), behaviour_logprobs=behaviour, mask=mask)


def test_icepop_keeps_the_ratio_inside_the_band_and_masks_outside():
    c = IcePop()(inp_from_ratios([[0.4, 0.5, 1.3, 5.0, 5.1]]))
    # k = 0.4 < 0.5 and 5.1 > 5: masked, weight 0; the band's ends are inside: weight k
    assert c.mask.tolist() == [[False, True, True, True, False]]
    torch.testing.assert_close(c.weights.double(), t([[0.0, 0.5, 1.3, 5.0, 0.0]], dtype=torch.float64))
    assert c.metrics["is/icepop_masked_frac"].item() == pytest.approx(2 / 5)
    c = IcePop(low=0.2, high=1.2)(inp_from_ratios([[0.4, 1.3]]))
    assert c.mask.tolist() == [[True, False]]
    with pytest.raises(ValueError, match="low < 1 < high"):
        IcePop(low=1.0, high=5.0)


def test_icepop_identity_when_sampler_equals_learner():
    c = IcePop()(inp_from_ratios([[1.0, 1.0], [1.0, 1.0]], mask=[[1, 0], [1, 1]]))
    assert c.mask.tolist() == [[True, False], [True, True]]
    torch.testing.assert_close(c.weights.double(), t([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert c.metrics["is/icepop_masked_frac"].item() == 0.0


def test_icepop_is_finite_with_extreme_and_infinite_logprobs():
    inf = float("inf")
    learner = t([[-1.0, -1.0, -2.0, -1.0], [-inf, -1.0, -1.0, -1.0]])
    behaviour = t([[-inf, -1001.0, -2.0, 999.0], [-inf, -1.0, -inf, -1.0]])
    mask = t([[0, 1, 1, 1], [0, 1, 0, 1]]).bool()
    c = IcePop()(CorrectionInputs(learner_logprobs=learner, behaviour_logprobs=behaviour, mask=mask))
    assert torch.isfinite(c.weights).all()
    # a ratio of e^+-1000 is far outside the band: dropped; the masked -inf positions stay masked
    assert c.mask.tolist() == [[False, False, True, False], [False, True, False, True]]
    assert c.metrics["is/icepop_masked_frac"].item() == pytest.approx(2 / 5)
    all_masked = IcePop()(CorrectionInputs(learner_logprobs=learner, behaviour_logprobs=behaviour,
                                           mask=torch.zeros_like(mask)))
    assert not all_masked.mask.any() and (all_masked.weights == 0).all()
    assert all_masked.metrics["is/icepop_masked_frac"].item() == 0.0


def test_icepop_composes_with_other_corrections():
    c = combine(inp_from_ratios([[0.4, 3.0, 1.5]]), [IcePop(), TokenTIS(cap=2.0)])
    # IcePop drops 0.4; TIS caps 3.0 at 2: weights 3 * 2 (both weights multiply), 1.5 * 1.5
    assert c.mask.tolist() == [[False, True, True]]
    torch.testing.assert_close(c.weights.double(), t([[0.0, 6.0, 2.25]], dtype=torch.float64))


def test_geometric_mean_sequence_rejection_by_hand():
    """MaskedIS(level="sequence") is the geometric-mean sequence rejection: the sequence's ratio is
    exp(mean_t log r_t) over its valid tokens, and the whole sequence goes when it leaves [low, high]."""
    ratios = [[4.0, 1.0, 1.0, 9.0], [3.0, 0.5, 1.0, 1.0], [0.2, 0.5, 1.0, 1.0]]
    mask = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    c = MaskedIS(low=0.5, high=1.5, level="sequence")(inp_from_ratios(ratios, mask))
    # seq 0: (4 * 1 * 1)^(1/3) = 1.587 > 1.5 (the masked 9 is not counted): dropped
    # seq 1: (3 * 0.5 * 1 * 1)^(1/4) = 1.5^(1/4) = 1.107 inside [0.5, 1.5]: kept, though 3 alone is outside
    # seq 2: (0.2 * 0.5)^(1/4) = 0.1^(1/4) = 0.562 inside: kept
    assert 4 ** (1 / 3) > 1.5 and 0.5 < 1.5 ** 0.25 < 1.5 and 0.5 < 0.1 ** 0.25 < 1.5
    assert c.mask.tolist() == [[False] * 4, [True] * 4, [True] * 4]
    assert c.metrics["is/seq_masked_frac"].item() == pytest.approx(1 / 3)
    # seq 2 with one more small ratio: (0.2 * 0.5 * 0.5 * 1)^(1/4) = 0.05^(1/4) = 0.473 < 0.5: dropped
    c = MaskedIS(low=0.5, high=1.5, level="sequence")(inp_from_ratios([[0.2, 0.5, 0.5, 1.0]]))
    assert math.isclose(0.05 ** 0.25, 0.4729, abs_tol=1e-4)
    assert c.mask.tolist() == [[False] * 4]
