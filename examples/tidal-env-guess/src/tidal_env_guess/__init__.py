"""Guess the number: a multi-turn Tidal environment in its own distribution (see README.md)."""

from tidal_env_guess.env import GuessEpisode, GuessNumber

__all__ = ["GuessEpisode", "GuessNumber"]
__version__ = "0.1.0"
