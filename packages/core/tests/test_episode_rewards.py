"""Rewards are real finite numbers: `real_reward` (what the environment process, the single-turn adapter and
the worker's scoring all check with) refuses strings, None, NaN and inf with the value in the message."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.episodes import NotAReward, SingleTurnEpisodes, real_reward
from tidal.core.interfaces import Task


@pytest.mark.parametrize("value", [1, 0, True, False, 0.25, -3.5, np.float32(0.5), np.int64(2), np.bool_(True),
                                   np.array(0.75)])
def test_bools_ints_floats_and_numpy_scalars_are_rewards(value):
    assert real_reward(value, "outcome()") == float(value)


@pytest.mark.parametrize(("value", "text"), [
    ("wrong", "outcome() returned 'wrong' (str), not a real number"),
    ("1.0", "outcome() returned '1.0' (str), not a real number"),
    (np.str_("1.0"), "not a real number"),
    (None, "outcome() returned None (NoneType), not a real number"),
    (float("nan"), "outcome() returned nan (float), not a finite number"),
    (float("-inf"), "outcome() returned -inf (float), not a finite number"),
    (np.float64("nan"), "not a finite number"),
    (np.array([1.0]), "(ndarray), not a real number"),
    ([1.0], "[1.0] (list), not a real number"),
])
def test_anything_else_is_refused_with_its_value_and_type(value, text):
    with pytest.raises(NotAReward) as e:
        real_reward(value, "outcome()")
    assert text in str(e.value) and e.value.what == "outcome()"


def test_a_huge_string_is_shown_cut_in_the_message():
    with pytest.raises(NotAReward) as e:
        real_reward("x" * 100_000, "outcome()")
    assert len(str(e.value)) < 200


class StringScore:
    def tasks(self, split, seed):
        return iter(())

    def score(self, task, completion):
        return "1.0"


def test_the_single_turn_adapter_refuses_a_score_that_is_a_string():
    episode = SingleTurnEpisodes(StringScore()).episode(Task(prompt="p"))
    episode.reset()
    episode.step("1")
    with pytest.raises(NotAReward, match=r"score\(\) returned '1.0' \(str\), not a real number"):
        episode.outcome()
