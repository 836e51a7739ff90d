"""`textarena`: a TextArena two-player game as a multi-role episode, for self-play RL.

Roles, TextArena's player ids: ``("player0", "player1")``; who moves when is the game's (Kuhn Poker's
first round opens with player1). An episode wraps one TextArena env (``textarena.make(env_id=game)``,
with the wrappers TextArena registers for that id), reset with the task's seed.

Observation (`Observation.text`, `Observation.role` = ``player<id>``): what TextArena's
``get_observation()`` gives the player to move. The ``-v0`` ids wrap the game in TextArena's
``LLMObservationWrapper``, whose text is the player's whole history so far, one ``\\n[GAME] ...`` /
``\\n[Player 1] ...`` line per message, so a role's first observation is that text as it is (the rules,
the board, any moves already made) and each later one only what was appended since that role's previous
observation: the player's own action as TextArena echoes it (``\\n[Player 0] [4]``), what the game said,
the opponent's moves, the new board. Appended after each of the role's actions, they make the role's
sample its conversation with the game. Where an id's text is not cumulative (the ``-train`` ids show the
prompt and the current board anew each turn), each later observation is the whole text with
``restart=True`` (the worker starts a new sample there). A ``-raw`` id gives messages, not text: they are
written as the default wrapper writes them (``\\n[GAME] message``), only those since the role's last turn.

Actions: the model's text, given to TextArena as it is; the ``-v0`` ids put brackets around an action
that has none (``4`` -> ``[4]``). An invalid move is TextArena's to handle: the player is told why and
moves again; a second invalid move in a row loses the game. A live action that was invalid has step info
``invalid_moves`` = 1.

Outcome (`outcome()`): TextArena's final rewards as floats: the winner +1.0 and the loser -1.0, a draw
0.0 each; a game lost by invalid moves is -1.0 for the offender and +1.0 for the other; a Kuhn Poker
match is won by the chips after all its rounds (not paid in chips). A game the worker cut at `max_turns`
before it ended is a draw (0.0 each). Step rewards are 0.

Roles named in task metadata `SCRIPTED_KEY` are played inside ``reset()``/``step()`` by the scripted
player (`scripted`: ``random``, a uniformly random valid action read from the game state; see
`tidal.textarena.titles`) and never come back as observations. Its draws are seeded by the task.

TextArena draws its randomness (Kuhn Poker's deals) from Python's module-level `random`, and its
``reset(seed=...)`` reseeds it. Each episode keeps a state of its own for it, swapped in around every call
into TextArena: a game replays identically from its task seed and the same live actions however episodes
interleave in one process, and the process's own `random` is left as it was. Hence episodes of one
process must not be stepped from several threads at once (environment processes serve one at a time).

Tasks: ``Task(prompt=<game id>, domain="textarena", metadata={"game": id, "seed": n})``; the seed seeds
TextArena's reset (the deal) and the scripted player. Train seeds are even, eval seeds odd, so the splits
never share a game; eval yields each seed twice in a row (a worker that alternates the live seat plays
it from both seats). TicTacToe always opens on the empty board: there a seed changes only the scripted
player's moves.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from tidal.core.episodes import AGENT, SCRIPTED_KEY, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.protocol import ToolSpec
from tidal.textarena.titles import SCRIPTED, supported_games

ROLES = ("player0", "player1")
DOMAIN = "textarena"
GAME_ID = -1  # the sender id of the game's own messages in TextArena (textarena.GAME_ID)


def _make(game: str) -> Any:
    import textarena  # imported here: checking a recipe's options must not import textarena

    return textarena.make(env_id=game)


class TextArenaEnv:
    """The `textarena` environment: `game` a TextArena id (`tidal.textarena.titles.supported_games`),
    `scripted` the player of the roles the worker names in `SCRIPTED_KEY` (``random``), `max_turns` the
    actions per role before the worker ends a game (0: the most a game of `game` can take, so that none is
    cut)."""

    domain = DOMAIN
    roles = ROLES

    def __init__(self, game: str = "TicTacToe-v0", scripted: str = "random", max_turns: int = 0) -> None:
        if scripted not in SCRIPTED:
            raise ValueError(f"scripted={scripted!r} is not a scripted player; choose one of {sorted(SCRIPTED)}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 0:
            raise ValueError(f"max_turns is the actions per role before a game is cut, an int >= 0 (0: never "
                             f"cut), got {max_turns!r}")
        games = supported_games()
        if game not in games:
            # heavy: textarena (and its dependencies); only an unsupported id's message needs its registry
            from textarena.envs.registration import ENV_REGISTRY

            why = ("this adapter has no scripted player for it" if game in ENV_REGISTRY
                   else "TextArena registers no game of that id")
            raise ValueError(f"game={game!r}: {why}; choose one of {sorted(games)}")
        self.game, self.scripted, self.title = game, scripted, games[game]
        self.max_turns = max_turns or self.title.role_turns(_make(game))

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """Endless: a new game seed per task, even for train and odd for eval (each eval seed twice in a row)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        rng = random.Random(f"textarena:{self.game}:{split}:{seed}")
        n = 0
        for i in itertools.count():
            if split == "train" or i % 2 == 0:
                n = 2 * rng.getrandbits(31) + (split == "eval")
            yield Task(prompt=self.game, domain=self.domain, metadata={"game": self.game, "seed": str(n)})

    def episode(self, task: Task) -> TextArenaEpisode:
        return TextArenaEpisode(self, task)


class TextArenaEpisode:
    """One game of one task (single use). Step each live role's turn with ``step(action, role)``."""

    roles: Sequence[str] = ROLES
    tools: Sequence[ToolSpec] = ()
    stop: Sequence[str] = ()  # a turn ends where sampling stops (EOS, the recipe's stop strings)

    def __init__(self, env: TextArenaEnv, task: Task) -> None:
        game = task.metadata.get("game", env.game)
        if game != env.game:
            raise ValueError(f"task of game {game!r} given to the textarena environment of {env.game!r}")
        try:
            self.seed = int(task.metadata["seed"])
        except (KeyError, ValueError):
            raise ValueError(f"a textarena task's metadata holds its game seed as an integer, e.g. "
                             f"{{'seed': '42'}}; got {dict(task.metadata)!r}") from None
        names = task.metadata.get(SCRIPTED_KEY, "")
        self.scripted = frozenset(r.strip() for r in names.split(",") if r.strip())
        if not self.scripted <= set(ROLES):
            raise ValueError(f"{SCRIPTED_KEY}={names!r} names roles a textarena game does not have; its roles "
                             f"are {ROLES}")
        if self.scripted == set(ROLES):
            raise ValueError(f"{SCRIPTED_KEY}={names!r} scripts every role: nobody is left to play")
        self.title, self.player = env.title, SCRIPTED[env.scripted]
        self.game = _make(env.game)  # TextArena's env, wrapped as TextArena registers the id
        self.rng = random.Random(zlib.crc32(f"{env.game}|{self.seed}".encode()))  # the scripted player's draws
        self._random = random.Random(self.seed).getstate()  # the game's module-level `random` (docstring)
        self._seen: dict[int, str] = {}  # player id -> its last whole observation text
        self._pid = 0  # the player to move (TextArena's id)
        self._raw: Any = None  # what get_observation() gave it: its text (a list of messages for -raw ids)
        self.rewards: dict[int, float] | None = None  # TextArena's, once the game is over
        self.started = False

    @property
    def done(self) -> bool:
        return self.rewards is not None

    def reset(self) -> Observation:
        if self.started:
            raise RuntimeError("reset() called twice: a textarena episode is single use")
        self.started = True
        with self._game_random():
            self.game.reset(num_players=len(ROLES), seed=self.seed)
            self._play_scripted()
        if self.done:
            raise RuntimeError(f"the game {self.game.env_id!r} ended before a live role moved")
        return self._observation()

    def step(self, action: str, role: str = AGENT) -> StepResult:
        if not self.started or self.done:
            raise RuntimeError("step() " + ("before reset()" if not self.started else "after the game ended"))
        if role != ROLES[self._pid]:
            raise ValueError(f"role {role!r} cannot move now: it is the turn of {ROLES[self._pid]!r}")
        with self._game_random():
            done, _ = self.game.step(action)
            state = self.game.state
            # a retry granted leaves error_count > 0; the invalid move that loses the game is marked instead
            invalid = getattr(state, "error_count", 0) > 0 or bool(state.game_info[self._pid].get("invalid_move"))
            if done:
                self._finish()
            else:
                self._play_scripted()
        info = {"invalid_moves": 1.0} if invalid else {}
        if self.done:
            return StepResult(done=True, info=info)
        return StepResult(observation=self._observation(), info=info)

    def outcome(self) -> Mapping[str, float]:
        if not self.started:
            raise RuntimeError("outcome() before reset()")
        if self.rewards is None:  # cut at max_turns by the worker: an unfinished game is a draw
            return dict.fromkeys(ROLES, 0.0)
        return {role: float(self.rewards[pid]) for pid, role in enumerate(ROLES)}

    def _play_scripted(self) -> None:
        """Play scripted turns until a live role is to move (its observation kept) or the game ends."""
        while True:
            self._pid, self._raw = self.game.get_observation()
            if ROLES[self._pid] not in self.scripted:
                return
            done, _ = self.game.step(self.player(self.title.actions(self.game), self.rng))
            if done:
                self._finish()
                return

    def _finish(self) -> None:
        rewards, _ = self.game.close()
        if not rewards or set(rewards) != set(range(len(ROLES))):
            raise RuntimeError(f"TextArena ended {self.game.env_id!r} without a reward for each player: {rewards!r}")
        self.rewards = {int(pid): float(r) for pid, r in rewards.items()}

    def _observation(self) -> Observation:
        pid, raw, role = self._pid, self._raw, ROLES[self._pid]
        if not isinstance(raw, str):  # a -raw id: the messages since this player's last turn
            return Observation(text="".join(f"\n[{self._sender(s)}] {m}" for s, m, *_ in raw or ()), role=role)
        last, self._seen[pid] = self._seen.get(pid), raw
        if last is None:
            return Observation(text=raw, role=role)
        if raw.startswith(last):
            return Observation(text=raw[len(last):], role=role)
        return Observation(text=raw, role=role, restart=True)

    def _sender(self, sender: int) -> str:
        return "GAME" if sender == GAME_ID else self.game.state.role_mapping.get(sender, f"Player {sender}")

    @contextmanager
    def _game_random(self) -> Iterator[None]:
        """Python's module-level `random` holds this episode's state while TextArena runs (docstring)."""
        outer = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)


__all__ = ["DOMAIN", "ROLES", "TextArenaEnv", "TextArenaEpisode"]
