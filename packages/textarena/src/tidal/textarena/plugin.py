"""tidal-textarena's plugin, registered through the `tidal` entry point: the environment ``textarena``.
The factory imports its module (and textarena) only when called, so scanning plugins stays cheap; it
declares the signature its options are checked against (`tidal.core.plugin_options`)."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import declare, hookimpl


@declare(signature="tidal.textarena.env:TextArenaEnv")
def textarena(**options: Any) -> Any:
    """A TextArena two-player game (TicTacToe, Kuhn Poker) for self-play, with a scripted opponent (+1/-1 per role)."""
    # imported when called: scanning plugins must not import textarena
    from tidal.textarena.env import TextArenaEnv

    return TextArenaEnv(**options)


@hookimpl
def tidal_envs() -> dict[str, Any]:
    return {"textarena": textarena}
