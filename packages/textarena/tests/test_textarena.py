"""The textarena environment: whole TicTacToe and Kuhn Poker games from either seat against the scripted
player and between two live roles, observations that extend each role's conversation, invalid moves,
well-formed outcomes, replayable games, the train/eval split, the plugin and its refusals, offline play."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys

import pytest

from tidal.core.episodes import SCRIPTED_KEY, Episode, EpisodicEnvironment, is_episodic
from tidal.core.errors import ConfigError
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.textarena import ROLES, SCRIPTED, TextArenaEnv, TextArenaEpisode, supported_games

GAMES = ("TicTacToe-v0", "KuhnPoker-v0")
# how the games list the valid actions in their text: "Available Moves: '[0]', '[4]'" (TicTacToe),
# "Your available actions are: '[check]', '[bet]'" (Kuhn Poker)
_LISTED = re.compile(r"(?:Available Moves|Your available actions are): ((?:'\[\w+\]'(?:, )?)+)")


@pytest.fixture(scope="module")
def envs() -> dict[str, TextArenaEnv]:
    return {game: TextArenaEnv(game=game) for game in GAMES}


def task(game: str, seed: int, scripted: str = "") -> Task:
    meta = {"game": game, "seed": str(seed)}
    if scripted:
        meta[SCRIPTED_KEY] = scripted
    return Task(prompt=game, domain="textarena", metadata=meta)


def listed(conversation: str) -> list[str]:
    """The valid actions a role's conversation lists last (what a live player reads)."""
    return re.findall(r"\[\w+\]", _LISTED.findall(conversation)[-1])


def play(episode: TextArenaEpisode, rng: random.Random, bad: int = 0):
    """A whole game, each live turn a random action among those its role's conversation lists (the
    first `bad` live turns an invalid action instead). Returns {role: [observation texts]}, the step infos
    and the number of live steps."""
    seen: dict[str, list[str]] = {}
    infos, steps = [], 0
    obs = episode.reset()
    while obs is not None:
        assert not obs.restart
        seen.setdefault(obs.role, []).append(obs.text)
        options = listed("".join(seen[obs.role]))
        assert options == episode.title.actions(episode.game)  # the text tells the truth of the state
        action = "(no move)" if steps < bad else rng.choice(options)
        result = episode.step(action, obs.role)
        steps += 1
        assert result.reward == 0.0 and result.done == (result.observation is None)
        infos.append(result.info)
        obs = result.observation
    return seen, infos, steps


def well_formed(outcome) -> None:
    assert set(outcome) == set(ROLES)
    assert all(type(r) is float and r in (-1.0, 0.0, 1.0) for r in outcome.values())
    assert outcome["player0"] == -outcome["player1"]  # both titles are zero-sum


# --------------------------------------------------------------------------- the plugin


def test_the_plugin_is_found_by_name_and_builds_an_episodic_environment() -> None:
    env = registry.build("env", "textarena", {"game": "TicTacToe-v0"})
    assert isinstance(env, EpisodicEnvironment) and is_episodic(env)
    assert env.game == "TicTacToe-v0" and env.roles == ROLES and env.max_turns == 10
    assert isinstance(env.episode(task("TicTacToe-v0", 0)), Episode)
    kuhn = registry.build("env", "textarena", {"game": "KuhnPoker-v0-short", "max_turns": 3})
    assert kuhn.max_turns == 3 and TextArenaEnv(game="KuhnPoker-v0-short").max_turns == 4 * 5


def test_bad_options_are_refused_naming_what_is_supported() -> None:
    with pytest.raises(ConfigError, match=r"'Chess-v0': this adapter has no scripted player.*'KuhnPoker-v0'.*'TicTacToe-v0'"):
        registry.build("env", "textarena", {"game": "Chess-v0"})
    with pytest.raises(ConfigError, match=r"'Tetris-v0': TextArena registers no game.*'TicTacToe-v0'"):
        registry.build("env", "textarena", {"game": "Tetris-v0"})
    with pytest.raises(ConfigError, match=r"minimax.*\['random'\]"):
        registry.build("env", "textarena", {"scripted": "minimax"})
    with pytest.raises(ConfigError, match="max_turns"):
        registry.build("env", "textarena", {"max_turns": -1})
    with pytest.raises(ConfigError, match="gmae"):
        registry.build("env", "textarena", {"gmae": "TicTacToe-v0"})
    assert set(SCRIPTED) == {"random"}
    assert {"TicTacToe-v0", "TicTacToe-v0-raw", "KuhnPoker-v0", "KuhnPoker-v0-long-train"} <= set(supported_games())


def test_bad_tasks_and_turns_are_refused(envs) -> None:
    env = envs["TicTacToe-v0"]
    with pytest.raises(ValueError, match="scripts every role"):
        env.episode(task("TicTacToe-v0", 0, "player0,player1"))
    with pytest.raises(ValueError, match="roles a textarena game does not have"):
        env.episode(task("TicTacToe-v0", 0, "first"))
    with pytest.raises(ValueError, match="seed"):
        env.episode(Task(prompt="TicTacToe-v0", metadata={"game": "TicTacToe-v0"}))
    with pytest.raises(ValueError, match="'KuhnPoker-v0' given to the textarena environment of 'TicTacToe-v0'"):
        env.episode(task("KuhnPoker-v0", 0))
    episode = env.episode(task("TicTacToe-v0", 0, "player1"))
    with pytest.raises(RuntimeError, match="before reset"):
        episode.step("[4]", "player0")
    episode.reset()
    with pytest.raises(ValueError, match="turn of 'player0'"):
        episode.step("[4]", "player1")
    with pytest.raises(RuntimeError, match="single use"):
        episode.reset()


# --------------------------------------------------------------------------- whole games


@pytest.mark.parametrize("game", GAMES)
@pytest.mark.parametrize("live", ROLES)
def test_whole_games_against_the_scripted_player_from_either_seat(envs, game: str, live: str) -> None:
    env, rng = envs[game], random.Random(7)
    other = ROLES[1 - ROLES.index(live)]
    outcomes = []
    for seed in range(12):
        episode = env.episode(task(game, seed, scripted=other))
        seen, infos, steps = play(episode, rng)
        assert set(seen) == {live}  # the scripted seat is never an observation
        assert steps <= env.max_turns and not any(infos)
        texts = seen[live]
        # the first observation is TextArena's text as it is, the later ones only what is new
        assert texts[0].startswith(f"\n[GAME] You are Player {live[-1]}")
        assert all("You are Player" not in t and t for t in texts[1:])
        assert "".join(texts) == episode.game.env._convert_obs_to_str(player_id=int(live[-1]))
        well_formed(episode.outcome())
        outcomes.append(episode.outcome()[live])
    assert len(set(outcomes)) > 1  # random play on both sides: not every game ends alike


@pytest.mark.parametrize("game", GAMES)
def test_two_live_roles_play_a_whole_game_each_with_its_own_conversation(envs, game: str) -> None:
    env = envs[game]
    seen, _, steps = play(env.episode(task(game, 3)), random.Random(3))
    assert set(seen) == set(ROLES) and steps >= 3
    for role, texts in seen.items():
        assert texts[0].startswith(f"\n[GAME] You are Player {role[-1]}")
        assert all("You are Player" not in t for t in texts[1:])


@pytest.mark.parametrize("game", ["TicTacToe-v0-raw", "KuhnPoker-v0-raw", "TicTacToe-v0-train", "KuhnPoker-v0-short-train"])
def test_raw_and_train_variants_play_whole_games(game: str) -> None:
    env, rng = TextArenaEnv(game=game), random.Random(1)
    episode = env.episode(task(game, 5, scripted="player1"))
    obs, turns = episode.reset(), []
    while obs is not None:
        turns.append(obs)
        obs = episode.step(rng.choice(episode.title.actions(episode.game)), obs.role).observation
    well_formed(episode.outcome())
    assert "You are Player 0" in turns[0].text
    if game.endswith("-raw"):  # messages written as the default wrapper writes them
        assert turns[0].text.startswith("\n[GAME] You are Player 0")
    # -train ids redraw the whole text each turn: later observations restart the conversation
    assert all(t.restart == game.endswith("-train") for t in turns[1:])


# --------------------------------------------------------------------------- invalid moves


@pytest.mark.parametrize("game", GAMES)
def test_an_invalid_move_is_retried_and_a_second_in_a_row_loses(envs, game: str) -> None:
    env = envs[game]
    seen, infos, _ = play(env.episode(task(game, 2, scripted="player1")), random.Random(0), bad=1)
    assert infos[0] == {"invalid_moves": 1.0} and not any(infos[1:])
    assert "attempted an invalid move" in seen["player0"][1]
    episode = env.episode(task(game, 2, scripted="player1"))
    obs = episode.reset()
    first = episode.step("(no move)", obs.role)
    assert first.observation.role == "player0" and not first.done
    last = episode.step("(still no move)", "player0")
    assert last.done and last.info == {"invalid_moves": 1.0}
    assert episode.outcome() == {"player0": -1.0, "player1": 1.0}


def test_a_game_cut_before_its_end_is_a_draw(envs) -> None:
    episode = envs["TicTacToe-v0"].episode(task("TicTacToe-v0", 0))
    obs = episode.reset()
    episode.step("[4]", obs.role)
    assert episode.outcome() == {"player0": 0.0, "player1": 0.0}


# --------------------------------------------------------------------------- determinism and tasks


def test_a_task_replays_identically_and_leaves_the_process_random_alone(envs) -> None:
    env = envs["KuhnPoker-v0"]
    t = task("KuhnPoker-v0", 11, scripted="player0")
    random.seed(99)
    before = random.getstate()
    runs = []
    for _ in range(2):
        episode = env.episode(t)
        seen, _, _ = play(episode, random.Random(5))
        runs.append((seen, episode.outcome()))
    assert runs[0] == runs[1]
    assert random.getstate() == before  # TextArena's reseeding stayed inside the episodes
    # interleaved with another game in the same process, the same task still deals the same cards
    a, b = env.episode(t), env.episode(task("KuhnPoker-v0", 12, scripted="player0"))
    oa, ob = a.reset(), b.reset()
    rng_a, rng_b, texts = random.Random(5), random.Random(6), [oa.text]
    while oa is not None:
        oa = a.step(rng_a.choice(listed("".join(texts))), oa.role).observation
        texts += [oa.text] if oa is not None else []
        if ob is not None:
            ob = b.step(rng_b.choice(b.title.actions(b.game)), ob.role).observation
    assert ({"player1": texts}, a.outcome()) == runs[0]
    # and different seeds deal different cards
    cards = {re.findall(r"Your card is: '(\w)'", env.episode(task("KuhnPoker-v0", s, "player0")).reset().text)[0]
             for s in range(12)}
    assert len(cards) > 1


def test_train_and_eval_tasks_are_seeded_apart_and_eval_covers_both_seats(envs) -> None:
    env = envs["TicTacToe-v0"]
    train = list(itertools.islice(env.tasks("train", 0), 20))
    evals = list(itertools.islice(env.tasks("eval", 0), 20))
    assert all(t.prompt == "TicTacToe-v0" and t.domain == "textarena" and t.metadata["game"] == "TicTacToe-v0"
               for t in train + evals)
    assert all(int(t.metadata["seed"]) % 2 == 0 for t in train)
    assert all(int(t.metadata["seed"]) % 2 == 1 for t in evals)
    assert [t.metadata for t in evals[0::2]] == [t.metadata for t in evals[1::2]]
    assert len({t.metadata["seed"] for t in evals}) == 10
    assert train == list(itertools.islice(env.tasks("train", 0), 20))
    assert train != list(itertools.islice(env.tasks("train", 1), 20))
    with pytest.raises(ValueError, match="split"):
        next(env.tasks("test", 0))


# --------------------------------------------------------------------------- light and offline


def test_scanning_and_checking_the_plugin_imports_no_textarena() -> None:
    code = ("import sys; from tidal.core.plugins import Registry; r = Registry(); r.table(); assert not r.failed;"
            "r.check('env', 'textarena', {'game': 'KuhnPoker-v0'});"
            "assert 'textarena' not in sys.modules, 'the plugin imported textarena'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_games_are_played_offline() -> None:
    """No socket may connect and nltk may download nothing while both titles are built and played."""
    code = """
import random, socket
def refuse(*a, **k): raise OSError("network use during an offline game")
socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse
socket.getaddrinfo = refuse
import nltk
nltk.download = refuse
from tidal.textarena import TextArenaEnv
for game in ("TicTacToe-v0", "KuhnPoker-v0"):
    env = TextArenaEnv(game=game)
    for t, _ in zip(env.tasks("train", 0), range(3)):
        t.metadata["tidal.scripted"] = "player1"
        episode, rng = env.episode(t), random.Random(0)
        obs = episode.reset()
        while obs is not None:
            obs = episode.step(rng.choice(episode.title.actions(episode.game)), obs.role).observation
        print(game, episode.outcome())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("player0") == 6
