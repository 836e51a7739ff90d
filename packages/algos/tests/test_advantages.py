"""Advantage estimators against values worked out by hand from each paper's formula."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    grpo_process_advantages,
    last_token_rewards,
    opo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    step_rewards_to_tokens,
    to_tokens,
)

t = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def test_grpo_normalises_by_group_mean_and_sample_std():
    # group 0: rewards 1,0,1 -> mean 2/3, sample std sqrt(1/3); group 1 all equal -> 0
    adv = grpo_advantages(t([1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), t([0, 0, 0, 1, 1, 1]), eps=0.0)
    s = math.sqrt(1 / 3)
    close(adv, [(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, 0, 0, 0])


def test_grpo_population_std_and_interleaved_groups():
    adv = grpo_advantages(t([1.0, 5.0, 0.0, 5.0, 1.0, 5.0]), t([0, 1, 0, 1, 0, 1]), eps=0.0, unbiased_std=False)
    s = math.sqrt(2 / 9)
    close(adv, [(1 / 3) / s, 0, (-2 / 3) / s, 0, (1 / 3) / s, 0])


def test_grpo_all_equal_and_singleton_groups_give_zero_not_nan():
    adv = grpo_advantages(t([0.0, 0.0, 0.0, 7.0]), t([0, 0, 0, 1]))
    assert torch.isfinite(adv).all()
    close(adv, [0, 0, 0, 0])


def test_dr_grpo_subtracts_only_the_mean():
    close(dr_grpo_advantages(t([1.0, 0.0, 1.0]), t([0, 0, 0])), [1 / 3, -2 / 3, 1 / 3])


def test_rloo_uses_the_mean_of_the_other_samples():
    # 1 - (0+1)/2, 0 - (1+1)/2, 1 - (1+0)/2
    close(rloo_advantages(t([1.0, 0.0, 1.0]), t([0, 0, 0])), [0.5, -1.0, 0.5])
    close(rloo_advantages(t([3.0]), t([0])), [0.0])


def test_opo_baseline_is_length_weighted():
    # b = (2*1 + 6*0) / 8 = 0.25
    close(opo_advantages(t([1.0, 0.0]), t([0, 0]), t([2.0, 6.0])), [0.75, -0.25])


def test_to_tokens_and_last_token_rewards():
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]]).bool()
    close(to_tokens(t([2.0, -1.0, 5.0]), mask), [[2, 2, 0], [-1, -1, -1], [0, 0, 0]])
    close(last_token_rewards(t([2.0, -1.0, 5.0]), mask), [[0, 2, 0], [0, 0, -1], [0, 0, 0]])


def test_reinforce_pp_whitens_returns_over_the_batch():
    mask = t([[1, 1, 0], [1, 1, 1]]).bool()
    adv = reinforce_pp_advantages(t([1.0, 0.0]), mask)
    # returns: [1, 1, -] and [0, 0, 0]; mean 0.4, population std sqrt(0.24)
    s = math.sqrt(0.24)
    close(adv, [[0.6 / s, 0.6 / s, 0], [-0.4 / s, -0.4 / s, -0.4 / s]], tol=1e-4)


def test_reinforce_pp_group_baseline_and_kl_penalty():
    mask = torch.ones(2, 2, dtype=torch.bool)
    penalty = t([[0.1, 0.1], [0.0, 0.0]])
    adv = reinforce_pp_advantages(t([1.0, 0.0]), mask, group_index=t([0, 0]), token_penalty=penalty)
    # baseline 0.5 -> rewards 0.5, -0.5; token rewards [-0.1, 0.4], [0, -0.5]; returns [0.3, 0.4], [-0.5, -0.5]
    ret = t([[0.3, 0.4], [-0.5, -0.5]])
    mean, std = ret.mean(), ret.std(unbiased=False)
    close(adv, (ret - mean) / std, tol=1e-4)


def test_discounted_returns_skip_masked_positions():
    r = t([[0.0, 9.0, 0.0, 1.0]])
    mask = t([[1, 0, 1, 1]]).bool()
    close(discounted_returns(r, mask, gamma=0.5), [[0.25, 0, 0.5, 1.0]])


def test_gae_matches_hand_computation():
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=0.5)
    # deltas 0.1, 0.1, 0.3; A2 = .3, A1 = .1 + .5*.3, A0 = .1 + .5*.25
    close(adv, [[0.225, 0.25, 0.3]])
    close(ret, [[0.725, 0.85, 1.0]])


def test_gae_with_lambda_one_gives_monte_carlo_returns():
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages(r, v, m, gamma=0.9, lam=1.0)
    close(adv, [[0.31, 0.3, 0.3]])
    close(ret, [[0.81, 0.9, 1.0]])


def test_gae_masked_gap_passes_through():
    r, v = t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.7]])
    adv, ret = gae_advantages(r, v, t([[1, 0, 1]]).bool(), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.0, 0.3]])  # masked token's reward and value are ignored
    close(ret, [[1.0, 0.0, 1.0]])


def test_gae_length_one_and_fully_masked_sequences():
    adv, ret = gae_advantages(t([[1.0], [3.0]]), t([[0.25], [1.0]]), t([[1], [0]]).bool())
    close(adv, [[0.75], [0.0]])
    close(ret, [[1.0], [0.0]])


def test_step_rewards_on_their_tokens():
    sr, ends = t([[0.5, 1.0]]), t([[2, 5]])
    close(step_rewards_to_tokens(sr, ends, 6, cumulative=False), [[0.5, 0.5, 1, 1, 1, 0]])
    close(step_rewards_to_tokens(sr, ends, 6, cumulative=True), [[1.5, 1.5, 1, 1, 1, 0]])


def test_grpo_process_supervision_normalises_steps_across_the_group():
    # steps in the group: 1, 0 (sample 0) and 1 (sample 1): mean 2/3, std sqrt(2/9)
    sr, ends = t([[1.0, 0.0], [1.0, 0.0]]), t([[1, 3], [2, -1]])
    adv = grpo_process_advantages(sr, ends, t([0, 0]), 3, eps=0.0)
    hi, lo = (1 / 3) / math.sqrt(2 / 9), (-2 / 3) / math.sqrt(2 / 9)
    close(adv, [[hi + lo, lo, lo], [hi, hi, 0]])


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(t([[1.0]]), t([0]))
