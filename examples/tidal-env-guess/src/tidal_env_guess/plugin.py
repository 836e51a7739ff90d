"""The `tidal` entry point: registers the environment ``guess_number``. Imports nothing heavy, so
scanning plugins stays cheap in every Tidal process."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import declare, hookimpl


@declare(signature="tidal_env_guess.env:GuessNumber")  # its options are checked before it is built
def guess_number(**options: Any) -> Any:
    """Guess an integer in [low, high] in turns; the environment answers higher / lower; a `hint` tool."""
    from tidal_env_guess.env import GuessNumber

    return GuessNumber(**options)


@hookimpl
def tidal_envs() -> dict[str, Any]:
    return {"guess_number": guess_number}
