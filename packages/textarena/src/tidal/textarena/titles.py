"""What this adapter knows of each TextArena title it supports: the actions valid at a point of a game
(what the scripted players choose from) and the most actions a role can take in one game (the default
`max_turns`). A title is a TextArena environment class; every id TextArena registers for that class
(``TicTacToe-v0``, its ``-raw`` and ``-train`` variants, ``KuhnPoker-v0-short``, ...) is supported.

The valid actions are read from the game's own state (``env.state.game_state``), never parsed from text:
TicTacToe's empty cells (``[k]``), Kuhn Poker's branches of its betting tree (``[check]``, ``[bet]``,
``[call]``, ``[fold]``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple


class Title(NamedTuple):
    """One TextArena game class, as this adapter plays it."""

    actions: Callable[[Any], list[str]]  # the valid actions of the player to move, from the (wrapped) env
    role_turns: Callable[[Any], int]  # the most actions one role takes in a game, invalid retries included


def _tictactoe_actions(game: Any) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]


def _kuhn_actions(game: Any) -> list[str]:
    return [f"[{move}]" for move in game.state.game_state["current_legal_action_tree"]]


# TextArena lets a player resubmit once after an invalid move (a second one in a row loses the game), so a
# role takes at most twice as many actions as valid moves: TicTacToe's first player places 5 marks at
# most; in a round of Kuhn Poker a player acts twice at most (check, then call or fold after a bet).
TITLES: dict[str, Title] = {
    "textarena.envs.TicTacToe.env:TicTacToeEnv": Title(_tictactoe_actions, lambda game: 2 * 5),
    "textarena.envs.KuhnPoker.env:KuhnPokerEnv": Title(_kuhn_actions, lambda game: 2 * 2 * int(game.max_rounds)),
}


def random_player(actions: list[str], rng: random.Random) -> str:
    """A uniformly random valid action."""
    return rng.choice(actions)


SCRIPTED: dict[str, Callable[[list[str], random.Random], str]] = {"random": random_player}


def supported_games() -> dict[str, Title]:
    """Every TextArena id this adapter plays (imports textarena), with its title."""
    # heavy: textarena (and its dependencies): scanning the plugin must not import it
    from textarena.envs.registration import ENV_REGISTRY

    return {env_id: TITLES[spec.entry_point] for env_id, spec in ENV_REGISTRY.items()
            if isinstance(spec.entry_point, str) and spec.entry_point in TITLES}


__all__ = ["SCRIPTED", "TITLES", "Title", "random_player", "supported_games"]
