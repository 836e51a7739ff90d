"""`nim`: a two-player game for self-play RL that the tiny char-level model can read and play.

One pile of stones (its starting size drawn from `piles`, 5..20 by default); the players take turns
taking 1..`max_take` (3) stones, and whoever takes the last stone wins. Roles, in turn order:
``("first", "second")``. The position is a win for the player to move unless the pile is a multiple of
``max_take + 1``: the optimal move takes ``pile % (max_take + 1)``.

Observation, the same for both roles (`Observation.text`, appended to the role's sample as it is, no
separator): ``nim <pile> take:``, the pile the role to move faces. Action: the model's text; its first
integer is the move (``2``, ``2\\n``). No integer, or one outside ``1..min(max_take, pile)``, is an illegal
move: the game ends at once, the offender gets `illegal_reward` (-2: worse than a loss, else a player in a
lost position learns nothing against making illegal moves) and the other role 0 (step info ``illegal_moves``).
Otherwise the winner gets +1 and the loser -1 (`outcome()`, a role -> reward mapping); step rewards are
0. A turn ends at a newline (`NimEpisode.stop`).

Roles named in task metadata `SCRIPTED_KEY` (set by the worker, e.g. for evaluation against the scripted
opponent) are played by the environment with its scripted player (`scripted`: ``random``, a uniformly
random legal move; ``optimal``, with `scripted_epsilon` the chance of a random move instead); only the
other roles' turns are observations. The scripted player's random draws are seeded by the task, so an
episode replays identically.

The plain rendering of a sample (what `demonstration` writes one turn of): the live role's observations
and its actions, e.g. the first player against a scripted second one::

    nim 13 take:2
    nim 9 take:1
    nim 5 take:1

i.e. ``"nim 13 take:"`` (environment), ``"2\\n"`` (model), ``"nim 9 take:"`` (environment, once the
scripted player took 2), ...

Tasks: the starting pile splits train from eval; piles that are multiples of `EVAL_EVERY` (5, 10, 15, 20
by default: one of each residue mod 4) are held out for evaluation, the rest train. Mid-game positions
of every size still occur in training: what is held out is the opening position.
"""

from __future__ import annotations

import itertools
import random
import re
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence

from tidal.core.episodes import AGENT, SCRIPTED_KEY, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.protocol import ToolSpec

ROLES = ("first", "second")
EVAL_EVERY = 5  # starting piles that are multiples of this are held out for evaluation
STOP = ("\n",)  # a turn ends at a newline (the plain renderer's stop too)
_MOVE = re.compile(r"-?\d+")
_MAX_DIGITS = 6  # a longer "number" is illegal without being converted (int() refuses 4,300+ digits)


def position(pile: int) -> str:
    """The observation text of a role to move facing `pile` stones."""
    return f"nim {pile} take:"


def random_move(pile: int, max_take: int, rng: random.Random) -> int:
    """A uniformly random legal move."""
    return rng.randint(1, min(max_take, pile))


def optimal_move(pile: int, max_take: int, rng: random.Random) -> int:
    """The winning move (leave a multiple of max_take + 1), or a random legal one where there is none."""
    return pile % (max_take + 1) or random_move(pile, max_take, rng)


SCRIPTED: dict[str, Callable[[int, int, random.Random], int]] = {"random": random_move, "optimal": optimal_move}


def read_move(action: str) -> int | None:
    """The move an action gives: its first integer; None when it has none (or an absurdly long one)."""
    m = _MOVE.search(action)
    if m is None or len(m.group()) > _MAX_DIGITS:
        return None
    return int(m.group())


class Nim:
    """The `nim` environment: `piles` = (lo, hi) starting piles, `max_take` stones at most per move,
    `scripted` the player of the roles the worker names in `SCRIPTED_KEY` (``random`` or ``optimal``),
    `scripted_epsilon` the chance that the optimal player moves at random instead."""

    domain = "nim"
    roles = ROLES

    def __init__(self, piles: tuple[int, int] = (5, 20), max_take: int = 3, scripted: str = "random",
                 scripted_epsilon: float = 0.0, illegal_reward: float = -2.0) -> None:
        if max_take < 1:
            raise ValueError(f"max_take is the most stones a move takes, at least 1, got {max_take}")
        if len(piles) != 2 or not max_take < piles[0] <= piles[1]:
            raise ValueError(f"piles is (lo, hi) with max_take ({max_take}) < lo <= hi, got {piles!r} (a pile "
                             f"of max_take or fewer ends at the first move: a scripted first player would "
                             f"leave the other role no turn)")
        if scripted not in SCRIPTED:
            raise ValueError(f"scripted={scripted!r} is not a scripted player; choose one of {sorted(SCRIPTED)}")
        if not 0.0 <= scripted_epsilon <= 1.0:
            raise ValueError(f"scripted_epsilon is a probability (0..1), got {scripted_epsilon}")
        lo, hi = self.piles = (int(piles[0]), int(piles[1]))
        self.eval_piles = [p for p in range(lo, hi + 1) if p % EVAL_EVERY == 0]
        self.train_piles = [p for p in range(lo, hi + 1) if p % EVAL_EVERY]
        if not self.eval_piles or not self.train_piles:
            raise ValueError(f"piles {piles!r} must hold both a multiple of {EVAL_EVERY} (held out for eval) "
                             f"and another size (trained on); widen the range")
        if not illegal_reward <= -1.0:
            raise ValueError(f"illegal_reward must be at most -1 (a loss), got {illegal_reward}: a player in a lost "
                             f"position would then gain by making an illegal move")
        self.max_take, self.scripted, self.scripted_epsilon = max_take, scripted, scripted_epsilon
        self.illegal_reward = float(illegal_reward)
        # every legal move takes a stone: a game has at most hi moves, however many roles are live
        self.max_turns = hi

    def _task(self, pile: int, seed: int) -> Task:
        return Task(prompt=position(pile), answer="", domain=self.domain,
                    metadata={"pile": str(pile), "max_take": str(self.max_take),
                              "max_pile": str(self.piles[1]), "seed": str(seed)})

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """Endless: train draws starting piles at random from `train_piles`; eval cycles through
        `eval_piles` in order, each twice in a row (so any first n cover them evenly, and a worker that
        alternates the live seat task by task plays each from both seats). Each task has its own opponent
        seed."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        rng = random.Random(f"nim:{split}:{seed}")
        for i in itertools.count():
            pile = rng.choice(self.train_piles) if split == "train" else self.eval_piles[i // 2 % len(self.eval_piles)]
            yield self._task(pile, rng.getrandbits(32))

    def scripted_move(self, pile: int, rng: random.Random) -> int:
        """The scripted player's move facing `pile`."""
        if self.scripted_epsilon and rng.random() < self.scripted_epsilon:
            return random_move(pile, self.max_take, rng)
        return SCRIPTED[self.scripted](pile, self.max_take, rng)

    def episode(self, task: Task) -> NimEpisode:
        return NimEpisode(self, task)


class NimEpisode:
    """One game of one task (single use). Step each live role's turn with ``step(action, role)``."""

    roles: Sequence[str] = ROLES
    tools: Sequence[ToolSpec] = ()
    stop: Sequence[str] = STOP

    def __init__(self, env: Nim, task: Task) -> None:
        try:
            self.pile = int(task.metadata["pile"])
        except (KeyError, ValueError):
            raise ValueError(f"a nim task's metadata holds its starting pile as an integer, e.g. "
                             f"{{'pile': '13'}}; got {dict(task.metadata)!r}") from None
        names = task.metadata.get(SCRIPTED_KEY, "")
        self.scripted = frozenset(r.strip() for r in names.split(",") if r.strip())
        if not self.scripted <= set(ROLES):
            raise ValueError(f"{SCRIPTED_KEY}={names!r} names roles nim does not have; its roles are {ROLES}")
        if self.scripted == set(ROLES):
            raise ValueError(f"{SCRIPTED_KEY}={names!r} scripts every role: nobody is left to play")
        if self.pile < 1 or ("first" in self.scripted and self.pile <= env.max_take):
            raise ValueError(f"pile {self.pile} cannot start a game here (need at least 1, and more than "
                             f"max_take={env.max_take} when the first role is scripted)")
        self.env = env
        # seeded by the task: the same task and the same live moves replay the same game
        self.rng = random.Random(zlib.crc32(f"{task.prompt}|{task.metadata.get('seed', '')}".encode()))
        self.turn = 0  # index into ROLES of the role to move
        self.winner: str | None = None
        self.offender: str | None = None  # the role that made an illegal move
        self.started = False

    @property
    def done(self) -> bool:
        return self.winner is not None or self.offender is not None

    def reset(self) -> Observation:
        if self.started:
            raise RuntimeError("reset() called twice: a nim episode is single use")
        self.started = True
        self._play_scripted()  # never ends the game: a scripted first move leaves stones (see __init__)
        return self._observation()

    def step(self, action: str, role: str = AGENT) -> StepResult:
        if not self.started or self.done:
            raise RuntimeError("step() " + ("before reset()" if not self.started else "after the game ended"))
        if role != ROLES[self.turn]:
            raise ValueError(f"role {role!r} cannot move now: it is the turn of {ROLES[self.turn]!r} (roles move "
                             f"in the order {ROLES})")
        move = read_move(action)
        if move is None or not 1 <= move <= min(self.env.max_take, self.pile):
            self.offender = role
            return StepResult(done=True, info={"illegal_moves": 1.0})
        self._take(move)
        self._play_scripted()
        return StepResult(done=True) if self.done else StepResult(observation=self._observation())

    def outcome(self) -> Mapping[str, float]:
        if self.offender is not None:
            return {r: self.env.illegal_reward if r == self.offender else 0.0 for r in ROLES}
        if self.winner is None:
            raise RuntimeError(f"outcome() before the game ended ({self.pile} stones left)")
        return {r: 1.0 if r == self.winner else -1.0 for r in ROLES}

    def _take(self, move: int) -> None:
        self.pile -= move
        if self.pile == 0:
            self.winner = ROLES[self.turn]
        else:
            self.turn = 1 - self.turn

    def _play_scripted(self) -> None:
        while not self.done and ROLES[self.turn] in self.scripted:
            self._take(self.env.scripted_move(self.pile, self.rng))

    def _observation(self) -> Observation:
        return Observation(text=position(self.pile), role=ROLES[self.turn])


def demonstration(task: Task, rng: random.Random) -> list[tuple[str, bool]]:
    """One turn for warm-start SFT as (text, written by the model) segments, byte for byte a turn of the
    plain rendering (module docstring): a position of any size 1..max pile (mid-game positions can be any
    size, whatever the task's starting pile) and a uniformly random legal move. The warm-started model
    knows the format and legality, not the strategy: that is for RL to learn."""
    max_take = int(task.metadata.get("max_take", "3"))
    pile = rng.randint(1, int(task.metadata.get("max_pile", task.metadata["pile"])))
    return [(position(pile), False), (f"{random_move(pile, max_take, rng)}\n", True)]


__all__ = ["EVAL_EVERY", "ROLES", "SCRIPTED", "STOP", "Nim", "NimEpisode", "demonstration", "optimal_move",
           "position", "random_move", "read_move"]
