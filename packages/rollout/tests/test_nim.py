"""The nim self-play environment: whole games between two live roles, scripted roles played inside the
environment, illegal moves, zero-sum outcomes, the scripted players' strength, replayable episodes, the
train/eval split, the warm-start demonstrations, and every text in the tiny tokenizer's alphabet."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from tidal.core.episodes import SCRIPTED_KEY, Episode, EpisodicEnvironment, is_episodic
from tidal.core.errors import ConfigError
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.rollout.envs.nim import (
    ROLES,
    STOP,
    Nim,
    NimEpisode,
    demonstration,
    optimal_move,
    position,
    random_move,
    read_move,
)
from tidal.rollout.tiny import ALPHABET


def task(pile: int, scripted: str = "", seed: int = 0) -> Task:
    meta = {"pile": str(pile), "seed": str(seed)}
    if scripted:
        meta[SCRIPTED_KEY] = scripted
    return Task(prompt=position(pile), answer="", domain="nim", metadata=meta)


def pile_of(text: str) -> int:
    assert text.startswith("nim ") and text.endswith(" take:"), text
    return int(text.removeprefix("nim ").removesuffix(" take:"))


def play(env: Nim, t: Task, player, rng: random.Random) -> tuple[NimEpisode, list[tuple[str, str]]]:
    """A whole game, every live turn played by `player(pile, max_take, rng)`; returns the episode and
    the (role, observation text) of each live turn."""
    episode = env.episode(t)
    obs = episode.reset()
    seen = []
    while obs is not None:
        seen.append((obs.role, obs.text))
        result = episode.step(f"{player(pile_of(obs.text), env.max_take, rng)}\n", obs.role)
        assert result.reward == 0.0
        assert result.done == (result.observation is None)
        obs = result.observation
    return episode, seen


def live_win_rate(env: Nim, player, games: int, seed: int = 0) -> float:
    """The live seat's win rate over `games` training tasks, the live seat alternating first/second."""
    rng, wins = random.Random(seed), 0
    for i, t in enumerate(itertools.islice(env.tasks("train", seed), games)):
        live, other = ROLES[i % 2], ROLES[1 - i % 2]
        episode, _ = play(env, Task(prompt=t.prompt, answer="", domain="nim",
                                    metadata={**t.metadata, SCRIPTED_KEY: other}), player, rng)
        wins += episode.outcome()[live] > 0
    return wins / games


# --------------------------------------------------------------------------- the plugin


def test_nim_is_an_episodic_env_plugin_found_by_name_with_checked_options() -> None:
    env = registry.build("env", "nim", {"piles": [5, 12], "max_take": 2, "scripted": "optimal"})
    assert isinstance(env, EpisodicEnvironment) and is_episodic(env)
    assert env.piles == (5, 12) and env.max_take == 2 and env.max_turns == 12
    assert isinstance(env.episode(task(7)), Episode)
    with pytest.raises(ConfigError, match="pile"):
        registry.build("env", "nim", {"pile": [5, 12]})
    with pytest.raises(ConfigError, match=r"minimax.*\['optimal', 'random'\]"):
        registry.build("env", "nim", {"scripted": "minimax"})
    with pytest.raises(ConfigError, match="scripted_epsilon acts only with scripted = 'optimal'"):
        registry.build("env", "nim", {"scripted_epsilon": 0.3})


def test_options_that_cannot_make_a_game_are_refused() -> None:
    with pytest.raises(ValueError, match="max_take"):
        Nim(max_take=0)
    with pytest.raises(ValueError, match="max_take"):
        Nim(piles=(3, 20))  # the first move could take the whole pile
    with pytest.raises(ValueError, match="multiple of 5"):
        Nim(piles=(6, 9))  # nothing to hold out
    with pytest.raises(ValueError, match="probability"):
        Nim(scripted="optimal", scripted_epsilon=1.5)
    with pytest.raises(ValueError, match="illegal_reward must be at most -1"):
        Nim(illegal_reward=0.0)


# --------------------------------------------------------------------------- games


def test_a_game_between_two_live_roles_alternates_and_the_last_taker_wins() -> None:
    env = Nim()
    episode = env.episode(task(7))
    assert episode.roles == ("first", "second") and tuple(episode.stop) == ("\n",) == STOP
    obs = episode.reset()
    assert (obs.role, obs.text, obs.messages) == ("first", "nim 7 take:", [])
    moves = [("first", "3\n", "nim 4 take:"), ("second", "1", "nim 3 take:"), ("first", " 2 stones\n", "nim 1 take:")]
    for role, action, shown in moves:
        result = episode.step(action, role)
        assert not result.done and result.observation.text == shown
        assert result.observation.role == ("second" if role == "first" else "first")
    result = episode.step("1\n", "second")
    assert result.done and result.observation is None and result.info == {}
    assert episode.outcome() == {"first": -1.0, "second": 1.0}


def test_step_refuses_a_role_whose_turn_it_is_not_and_a_finished_game() -> None:
    episode = Nim().episode(task(6))
    episode.reset()
    with pytest.raises(ValueError, match="role 'second' cannot move now: it is the turn of 'first'"):
        episode.step("1", "second")
    with pytest.raises(ValueError, match="role 'agent' cannot move now"):
        episode.step("1")  # a worker that does not know the episode has roles
    with pytest.raises(RuntimeError, match="before the game ended"):
        episode.outcome()
    episode.step("x", "first")
    with pytest.raises(RuntimeError, match="after the game ended"):
        episode.step("1", "second")


@pytest.mark.parametrize("action", ["", "x", "take two\n", "0\n", "4\n", "-1\n", "3\n", "9" * 40])
def test_an_illegal_move_ends_the_game_and_costs_only_the_offender(action: str) -> None:
    episode = Nim().episode(task(6))
    episode.reset()
    assert not episode.step("2\n", "first").done
    assert not episode.step("2\n", "second").done  # 2 stones left: 3 is illegal now too
    result = episode.step(action, "first")
    assert result.done and result.observation is None and result.info == {"illegal_moves": 1.0}
    assert episode.outcome() == {"first": -2.0, "second": 0.0}  # worse than a loss: never a way out of one


def test_read_move_takes_the_first_integer() -> None:
    assert [read_move(a) for a in ("2\n", " 3", "take 1 then 2", "x", "", "-2", "1234567")] == \
        [2, 3, 1, None, None, -2, None]


def test_a_scripted_first_role_moves_inside_the_environment() -> None:
    env = Nim()
    for seed in range(50):
        episode, seen = play(env, task(13, scripted="first", seed=seed), random_move, random.Random(seed))
        assert seen and all(role == "second" for role, _ in seen)
        assert 13 - env.max_take <= pile_of(seen[0][1]) < 13  # the scripted player already moved
        outcome = episode.outcome()
        assert sorted(outcome.values()) == [-1.0, 1.0] and sum(outcome.values()) == 0.0


def test_a_scripted_second_role_moves_inside_the_environment_and_can_end_the_game() -> None:
    env = Nim(scripted="optimal")
    ended_by_script = 0
    for seed in range(50):
        episode, seen = play(env, task(9, scripted=" second ", seed=seed), random_move, random.Random(seed))
        assert all(role == "first" for role, _ in seen)
        outcome = episode.outcome()
        assert sum(outcome.values()) == 0.0
        ended_by_script += outcome["second"] == 1.0
    assert ended_by_script > 0  # games the scripted move ended: done with no observation


def test_scripted_roles_the_game_does_not_have_are_refused() -> None:
    env = Nim()
    with pytest.raises(ValueError, match="roles nim does not have"):
        env.episode(task(9, scripted="black"))
    with pytest.raises(ValueError, match="nobody is left to play"):
        env.episode(task(9, scripted="first,second"))
    with pytest.raises(ValueError, match="starting pile"):
        env.episode(Task(prompt="nim", answer="", domain="nim"))


def test_a_game_fits_max_turns_even_one_stone_at_a_time() -> None:
    env = Nim(piles=(5, 9))
    episode = env.episode(task(9))
    obs, steps = episode.reset(), 0
    while obs is not None:
        steps += 1
        obs = episode.step("1\n", obs.role).observation
    assert steps == 9 <= env.max_turns and episode.outcome() == {"first": 1.0, "second": -1.0}


# --------------------------------------------------------------------------- the scripted players


def test_the_optimal_scripted_player_never_loses_a_winning_position() -> None:
    env = Nim(scripted="optimal")
    for pile, seed in itertools.product(range(5, 21), range(8)):
        rng = random.Random(seed)
        # it moves first from a non-multiple of 4, or second after the live player faced a multiple of 4
        seat = "first" if pile % 4 else "second"
        episode, _ = play(env, task(pile, scripted=seat, seed=seed), random_move, rng)
        assert episode.outcome()[seat] == 1.0, (pile, seed)


def test_optimal_beats_random_most_of_the_time() -> None:
    assert live_win_rate(Nim(), optimal_move, 500) > 0.8  # the live optimal seat against the scripted random
    assert live_win_rate(Nim(scripted="optimal"), random_move, 500) < 0.2  # and the other way round
    # a random move now and then makes the optimal scripted player beatable
    weaker = live_win_rate(Nim(scripted="optimal", scripted_epsilon=0.5), random_move, 500)
    assert 0.2 < weaker < 0.5


# --------------------------------------------------------------------------- replay, tasks, text


def test_an_episode_replays_identically_for_the_same_task() -> None:
    env = Nim()
    games = [play(env, task(17, scripted="first", seed=s), random_move, random.Random(0))[1] for s in (3, 3, 4, 5)]
    assert games[0] == games[1]
    assert games[0] != games[2] or games[0] != games[3]  # the task's seed is the opponent's


def test_tasks_split_train_and_eval_by_starting_pile() -> None:
    env = Nim()
    train = list(itertools.islice(env.tasks("train", seed=0), 500))
    held_out = list(itertools.islice(env.tasks("eval", seed=0), 16))
    # evenly, in order, each twice in a row: seats alternated task by task play each from both seats
    assert [t.metadata["pile"] for t in held_out] == ["5", "5", "10", "10", "15", "15", "20", "20"] * 2
    assert {int(t.metadata["pile"]) for t in train} == set(range(5, 21)) - {5, 10, 15, 20}
    assert [t.metadata for t in itertools.islice(env.tasks("train", seed=0), 20)] == [t.metadata for t in train[:20]]
    assert len({t.metadata["seed"] for t in train}) > 400  # each its own opponent's draws
    for t in (*train[:50], *held_out):
        assert t.domain == "nim" and t.answer == "" and t.prompt == position(int(t.metadata["pile"]))
        assert all(isinstance(v, str) for v in t.metadata.values()) and SCRIPTED_KEY not in t.metadata
    with pytest.raises(ValueError, match="split"):
        next(env.tasks("test", 0))


def test_demonstrations_show_any_position_and_a_uniformly_random_legal_move() -> None:
    env, rng = Nim(), random.Random(0)
    shown: Counter[tuple[int, int]] = Counter()
    for t in itertools.islice(env.tasks("train", seed=0), 4000):
        (prompt, prompt_trained), (move, move_trained) = demonstration(t, rng)
        assert not prompt_trained and move_trained and move.endswith("\n")
        pile, take = pile_of(prompt), read_move(move)
        assert 1 <= take <= min(3, pile)
        shown[pile, take] += 1
    assert {p for p, _ in shown} == set(range(1, 21))  # every size, the eval piles' too
    assert {m for p, m in shown if p >= 3} == {1, 2, 3}
    for pile in range(3, 21):  # uniform over the legal moves, not the winning one
        counts = [shown[pile, m] for m in (1, 2, 3)]
        assert min(counts) > 0.5 * max(counts), (pile, counts)


def test_every_text_of_a_game_encodes_with_the_tiny_tokenizer() -> None:
    from tidal.rollout.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    env, rng = Nim(), random.Random(0)
    texts = {position(p) for p in range(1, 21)}
    for seed in range(20):
        texts.update(text for _, text in play(env, task(20, scripted=ROLES[seed % 2], seed=seed), random_move, rng)[1])
    texts.update(seg for t in itertools.islice(env.tasks("train", 0), 50) for seg, _ in demonstration(t, rng))
    for text in texts:
        assert set(text) <= set(ALPHABET)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # a live role's sample, as the worker appends text observations after each sampled action
    _, seen = play(env, task(13, scripted="second", seed=1), optimal_move, rng)
    sample = "".join(f"{text}{optimal_move(pile_of(text), 3, rng)}\n" for _, text in seen)
    assert sample.startswith("nim 13 take:1\nnim ") and tok.decode(tok.encode(sample)) == sample
