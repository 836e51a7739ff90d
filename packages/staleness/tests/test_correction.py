"""IS corrections against hand-computed values; identity when sampler == learner; ESS and mismatch KL
checked on known distributions."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.staleness import (
    CorrectionInputs,
    DecoupledPPO,
    KVLagMask,
    MaskedIS,
    OffPolicySequenceMask,
    SequenceTIS,
    TokenTIS,
    combine,
    effective_sample_size,
    mismatch_kl,
    sequence_lags,
    step_metrics,
)

t = torch.tensor
LN = math.log


def inp_from_ratios(ratios, mask=None, **kw):
    r = t(ratios, dtype=torch.float64)
    behaviour = torch.full_like(r, -1.0)
    mask = torch.ones_like(r, dtype=torch.bool) if mask is None else t(mask).bool()
    return CorrectionInputs(learner_logprobs=behaviour + r.log(), behaviour_logprobs=behaviour, mask=mask, **kw)


def w(c):
    return c.weights.double()


def test_token_tis_truncates_at_cap():
    c = TokenTIS(cap=2.0)(inp_from_ratios([[0.5, 1.5, 3.0]]))
    torch.testing.assert_close(w(c), t([[0.5, 1.5, 2.0]], dtype=torch.float64))
    assert c.metrics["is/token_truncated_frac"].item() == pytest.approx(1 / 3)


def test_sequence_tis_uses_the_geometric_mean():
    c = SequenceTIS(cap=2.0)(inp_from_ratios([[2.0, 0.5, 4.0], [4.0, 4.0, 1.0]], mask=[[1, 1, 0], [1, 1, 1]]))
    # seq 0: sqrt(2 * 0.5) = 1 over its 2 valid tokens; seq 1: (16)^(1/3) = 2.52 -> capped at 2
    torch.testing.assert_close(w(c), t([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]], dtype=torch.float64))
    assert c.metrics["is/seq_truncated_frac"].item() == pytest.approx(0.5)


def test_masked_is_token_and_sequence_level():
    c = MaskedIS(low=0.5, high=2.0)(inp_from_ratios([[0.4, 0.5, 2.0, 2.1]]))
    assert c.mask.tolist() == [[False, True, True, False]]
    c = MaskedIS(low=0.5, high=2.0, level="sequence")(inp_from_ratios([[4.0, 2.0], [1.0, 1.2]]))
    assert c.mask.tolist() == [[False, False], [True, True]]  # seq 0 geometric mean sqrt(8) > 2
    with pytest.raises(ValueError, match="low < 1 < high"):
        MaskedIS(low=1.5, high=2.0)


def test_off_policy_sequence_mask_needs_negative_advantage_and_high_kl():
    ratios = [[3.0, 3.0], [3.0, 3.0], [1.0, 1.0]]
    adv = t([-1.0, 1.0, -1.0])
    c = OffPolicySequenceMask(delta=0.1)(inp_from_ratios(ratios, advantages=adv))
    # k3 at r = 3: 3 - 1 - ln 3 = 0.90 > 0.1; only the negative-advantage one is masked
    assert c.mask.tolist() == [[False, False], [True, True], [True, True]]
    with pytest.raises(ValueError, match="needs CorrectionInputs.advantages"):
        OffPolicySequenceMask()(inp_from_ratios(ratios))


def test_decoupled_ppo_weight_is_proximal_over_behaviour():
    behaviour = t([[-1.0, -2.0]], dtype=torch.float64)
    prox = behaviour + t([[LN(2.0), LN(0.5)]], dtype=torch.float64)
    inp = CorrectionInputs(learner_logprobs=prox + 0.3, behaviour_logprobs=behaviour, proximal_logprobs=prox,
                           mask=torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(w(DecoupledPPO()(inp)), t([[2.0, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(w(DecoupledPPO(cap=1.5)(inp)), t([[1.5, 0.5]], dtype=torch.float64))


def test_kv_lag_mask_drops_tokens_whose_kv_cache_is_too_old():
    inp = inp_from_ratios([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], mask=[[1, 1, 1, 1], [1, 1, 0, 0]],
                          kv_lag=t([[0, 2, 3, 5], [1, 4, 9, 9]]))
    c = KVLagMask(max_kv_lag=2)(inp)
    assert c.mask.tolist() == [[True, True, False, False], [True, False, False, False]]
    torch.testing.assert_close(c.weights, c.mask.float())
    assert c.metrics["is/kv_lag_masked_frac"].item() == pytest.approx(3 / 6)  # of the real tokens
    assert KVLagMask(max_kv_lag=9)(inp).mask.tolist() == inp.mask.tolist()
    with pytest.raises(ValueError, match="max_kv_lag"):
        KVLagMask(max_kv_lag=-1)


def test_kv_lag_mask_without_kv_lag_is_the_identity_and_says_so_once(caplog):
    inp = inp_from_ratios([[1.0, 2.0, 0.5]], mask=[[1, 1, 0]])
    policy = KVLagMask(max_kv_lag=0)
    with caplog.at_level("WARNING", logger="tidal.staleness"):
        for _ in range(3):
            c = policy(inp)
            assert c.mask.tolist() == [[True, True, False]] and c.weights.tolist() == [[1.0, 1.0, 0.0]]
            assert not c.metrics
    assert sum("kv_versions" in r.getMessage() for r in caplog.records) == 1


def test_combine_multiplies_weights_and_ands_masks():
    inp = inp_from_ratios([[0.4, 1.5, 3.0]])
    c = combine(inp, [TokenTIS(cap=2.0), MaskedIS(low=0.5, high=2.5)])
    assert c.mask.tolist() == [[False, True, False]]
    torch.testing.assert_close(w(c), t([[0.0, 1.5, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize(
    "policy",
    [TokenTIS(1.5), SequenceTIS(1.5), MaskedIS(0.9, 1.1), MaskedIS(0.9, 1.1, "sequence"),
     OffPolicySequenceMask(1e-6), DecoupledPPO(1.2), KVLagMask(2)],
    ids=lambda p: type(p).__name__,
)
def test_every_correction_is_identity_when_behaviour_equals_learner(policy):
    torch.manual_seed(0)
    lp = -torch.rand(4, 6)
    mask = torch.rand(4, 6) > 0.2
    inp = CorrectionInputs(learner_logprobs=lp, behaviour_logprobs=lp.clone(), mask=mask,
                           advantages=-torch.ones(4), proximal_logprobs=lp.clone(),
                           kv_lag=torch.ones(4, 6, dtype=torch.long))  # KV as fresh as the tokens
    c = policy(inp)
    assert torch.equal(c.mask, mask)
    torch.testing.assert_close(c.weights, mask.to(c.weights.dtype))
    assert all(v.item() == 0 for k, v in c.metrics.items() if k.endswith("frac"))


def test_ess_formula():
    assert effective_sample_size(torch.ones(10)).item() == pytest.approx(1.0)
    assert effective_sample_size(t([5.0, 0, 0, 0])).item() == pytest.approx(0.25)
    assert effective_sample_size(t([1.0, 3.0])).item() == pytest.approx(16 / (2 * 10))


def test_ess_and_mismatch_kl_on_known_distributions():
    # sampler q, learner p over 4 tokens: weights p/q on q-samples
    p = t([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = t([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    x = torch.multinomial(q, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    weights = (p / q)[x]
    # E_q[w^2] = sum p^2 / q -> normalised ESS -> 1 / sum(p^2/q)
    expected_ess = 1 / float((p * p / q).sum())
    assert effective_sample_size(weights).item() == pytest.approx(expected_ess, abs=5e-3)
    kl_q_p = float((q * (q / p).log()).sum())  # KL(sampler || learner)
    m = mismatch_kl(p.log()[x][None], q.log()[x][None], torch.ones(1, x.numel(), dtype=torch.bool))
    assert m["mismatch/kl_k1"].item() == pytest.approx(kl_q_p, abs=5e-3)
    assert m["mismatch/kl_k3"].item() == pytest.approx(kl_q_p, abs=5e-3)


def test_sequence_lags_and_step_metrics():
    versions = t([[3, 3, 4, 5], [5, 5, 0, 0]])
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    lags = sequence_lags(versions, mask, current_version=6)
    assert lags["min"].tolist() == [1, 1] and lags["max"].tolist() == [3, 1]
    assert lags["mean"].tolist() == pytest.approx([2.25, 1.0])
    inp = inp_from_ratios([[1.0, 1.0, 3.0, 1.0], [0.1, 1.0, 1.0, 1.0]], mask=mask.int().tolist())
    corr = combine(inp, [MaskedIS(0.5, 2.0)])
    m = step_metrics(inp.learner_logprobs, inp.behaviour_logprobs, mask, corr, versions, 6)
    assert m["is/token_masked_total_frac"].item() == pytest.approx(2 / 6)
    assert m["is/seq_masked_total_frac"].item() == 0.0
    assert m["lag/max"].item() == 3 and m["lag/mean"].item() == pytest.approx(1.625)
    assert 0 < m["is/ess"].item() <= 1
