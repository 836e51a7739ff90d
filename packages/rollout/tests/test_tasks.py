"""The built-in environments: held-out problems never trained on, rewards, and Reverse's long tail."""

from __future__ import annotations

import itertools

import pytest

from tidal.core.plugins import registry
from tidal.rollout.envs.tasks import Countdown, Reverse, first_tasks


def test_reverse_rewards_only_the_exact_reversal() -> None:
    env = Reverse()
    task = next(env.tasks("train", seed=0))
    word = task.prompt.removeprefix("rev ").removesuffix(":")
    assert task.answer == word[::-1] and task.metadata["length"] == str(len(word))
    assert env.score(task, task.answer + "\nrest") == 1.0
    assert env.score(task, " " + task.answer + " ") == 1.0
    assert env.score(task, word + "x") == 0.0


def test_reverse_lengths_have_the_configured_tail() -> None:
    env = Reverse(min_len=2, short_len=6, long_len=16, max_len=40, tail=0.15)
    lengths = [len(t.answer) for t in itertools.islice(env.tasks("train", seed=1), 4000)]
    long = [n for n in lengths if n >= 16]
    assert all(2 <= n <= 6 or 16 <= n <= 40 for n in lengths)
    assert 0.12 < len(long) / len(lengths) < 0.18  # 15 % +- sampling noise at n = 4000
    assert max(lengths) == 40


def test_eval_and_train_splits_are_disjoint() -> None:
    for env in (Reverse(), Countdown()):
        held_out = {t.prompt for t in first_tasks(env, "eval", seed=0, n=100)}
        train = {t.prompt for t in itertools.islice(env.tasks("train", seed=0), 2000)}
        assert len(held_out) == 100 and not held_out & train


def test_reverse_is_a_registered_env_and_refuses_bad_lengths() -> None:
    assert isinstance(registry.create("env", "reverse", max_len=20, long_len=10), Reverse)
    with pytest.raises(ValueError, match="min_len <= short_len"):
        Reverse(short_len=10, long_len=8)
    with pytest.raises(ValueError, match="probability"):
        Reverse(tail=1.5)
