"""The driver's watch on the learning signal (tidal.integration.signal_watch) and the learner's per-group
counts behind it (tidal.learner.metrics.group_signal)."""

from __future__ import annotations

import numpy as np

from tidal.core.arrays import Array
from tidal.core.protocol import Trajectory
from tidal.integration.signal_watch import FIRST, STREAK, LearningSignal
from tidal.learner.metrics import group_signal


def _row(frac: float, n: int = 64) -> dict[str, float]:
    return {"signal/nonzero_adv_frac": frac, "train/sequences": float(n), "signal/zero_variance_frac": 1 - frac}


def test_no_signal_in_the_first_versions_warns_once_and_the_run_learned_nothing():
    s = LearningSignal()
    warnings = [s.observe(_row(0.0)) for _ in range(FIRST + 40)]
    assert [i for i, w in enumerate(warnings) if w] == [FIRST - 1]
    assert "first 20 versions" in warnings[FIRST - 1] and "tidal sft" in warnings[FIRST - 1]
    assert s.learned_nothing().startswith(f"{FIRST + 40} versions trained, but 0.0 % of")


def test_a_run_that_learns_then_goes_flat_for_a_streak_warns_but_learned_something():
    s = LearningSignal()
    assert not any(s.observe(_row(0.5)) for _ in range(30))
    warnings = [s.observe(_row(0.0)) for _ in range(STREAK)]
    assert warnings[-1].startswith(f"no learning signal for {STREAK} versions in a row") and not any(warnings[:-1])
    assert s.learned_nothing() == ""  # 30 versions carried a signal: it learned, then ran dry (all solved?)


def test_a_few_samples_with_signal_keep_the_run_quiet():
    s = LearningSignal()
    assert not any(s.observe(_row(0.05)) for _ in range(100)) and s.learned_nothing() == ""
    assert LearningSignal().learned_nothing() == "" and not LearningSignal().observe({"loss/total": 1.0})


def test_a_run_shorter_than_the_first_window_is_not_judged():
    s = LearningSignal()
    assert not any(s.observe(_row(0.0)) for _ in range(FIRST - 1)) and s.learned_nothing() == ""


def _t(group: str, reward: float, task: str = "arith") -> Trajectory:
    ids = Array.from_numpy(np.zeros(2, np.int32))
    return Trajectory(id=f"{group}-{reward}-{np.random.rand()}", group_id=group, sample_index=0, task=task,
                      prompt_ids=ids, completion_ids=ids, logprobs=Array.from_numpy(np.zeros(2, np.float32)),
                      versions=ids, reward=reward, finish_reason="stop")


def test_groups_with_equal_rewards_are_counted_all_zero_and_all_at_the_best_apart():
    batch = [_t("a", 0.0), _t("a", 0.0), _t("b", 1.0), _t("b", 1.0), _t("c", 0.0), _t("c", 1.0), _t("d", 0.5)]
    out = group_signal(batch)  # d has one sample: no group to compare within
    assert out == {"signal/groups": 3.0, "signal/zero_variance_frac": 2 / 3, "signal/all_zero_frac": 1 / 3,
                   "signal/all_max_frac": 1 / 3}
    two = group_signal([_t("a", 0.0), _t("a", 0.0), _t("x", 1.0, "words"), _t("x", 0.0, "words")])
    assert two["signal/arith/zero_variance_frac"] == 1.0 and two["signal/words/zero_variance_frac"] == 0.0
