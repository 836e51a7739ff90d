"""What the environment process checks in what an author's episode returns, before it leaves the process.

- Rewards (``outcome()``, each step's reward, a single-turn env's ``score()``) are real finite numbers
  (`tidal.core.episodes.real_reward`). Anything else ends the episode as a ``verifier_error`` whose text
  names the value, its type, the environment and the author's file and line, e.g.
  ``outcome() returned 'wrong' (str), not a real number (env unitconv, unitconv_tidal/env.py:82)``;
  never a substitute reward. The first occurrence of each distinct bad value is logged (`MAX_LOGGED` per
  domain and call), so the environment log shows what the verifier really returned.
- Observations are capped at `max_observation_chars` characters: the rest is dropped and a visible
  marker says how much, ``(... truncated: N characters, M dropped)`` (characters even the demo models'
  narrow tokenizers can write; brackets are not), so that the rollout worker never tokenises an
  unbounded string (a tool that dumps 50 MB would otherwise stall its renderer for minutes). The reply's
  info counts it (`TRUNCATED`, `CHARS_DROPPED`), which the worker reports as
  ``rollout/episodes/info/<key>``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.core.episodes import NotAReward, real_reward
from tidal.core.protocol import ChatMessage

log = logging.getLogger("tidal.rollout.envproc")

MAX_LOGGED = 8  # distinct bad values logged per (domain, call); later ones are only counted by the pool
TRUNCATED = "observations_truncated"  # EpisodeReply.info: observations cut at max_observation_chars
CHARS_DROPPED = "observation_chars_dropped"  # EpisodeReply.info: characters they lost


class BadReward(Exception):
    """A reward that is not a real finite number; the message says which, and where it came from."""


def source_line(func: Any) -> str:
    """Where `func` is defined, as ``package/module.py:LINE`` relative to its top-level package's folder
    (site-packages or a source tree alike); "" when Python cannot tell (a builtin, a lambda in a REPL)."""
    try:
        func = inspect.unwrap(getattr(func, "__func__", func))
        path = Path(inspect.getsourcefile(func) or "")
        line = inspect.getsourcelines(func)[1]
    except (TypeError, OSError):
        return ""
    top = sys.modules.get(getattr(func, "__module__", "").split(".")[0])
    if getattr(top, "__path__", None):  # a package: paths from the folder that holds it
        base = Path(next(iter(top.__path__))).parent  # type: ignore[union-attr]
    elif getattr(top, "__file__", None):  # a top-level module
        base = Path(top.__file__).parent  # type: ignore[union-attr, arg-type]
    else:
        base = path.parent
    try:
        path = path.resolve().relative_to(base.resolve())
    except ValueError:  # defined outside its package (a re-export): the file name alone still helps
        path = Path(path.name)
    return f"{path.as_posix()}:{line}"


class RewardCheck:
    """Checks the rewards of one environment process's episodes, logging each distinct bad value once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._seen: dict[tuple[str, str], set[str]] = {}  # (domain, call) -> reprs of the bad values logged
        self._where: dict[Any, str] = {}

    def reward(self, value: Any, what: str, func: Any, domain: str, env: str, episode_id: str) -> float:
        """`value` as a float, or BadReward naming it and `func`'s file and line."""
        try:
            return real_reward(value, what)
        except NotAReward as e:
            raise self.refused(e, func, domain, env, episode_id) from None

    def refused(self, e: NotAReward, func: Any, domain: str, env: str, episode_id: str) -> BadReward:
        """The BadReward for a refused value (the first of each distinct one logged with its repr)."""
        key = getattr(func, "__func__", func)
        if key not in self._where:
            self._where[key] = source_line(func)
        where = self._where[key]
        text = f"{e} (env {env}{', ' + where if where else ''})"
        seen = self._seen.setdefault((domain, e.what), set())
        shown = f"{e.value!r:.80}"
        if shown not in seen and len(seen) < MAX_LOGGED:
            seen.add(shown)
            more = "" if len(seen) < MAX_LOGGED else f"; further distinct values of {e.what} are not logged"
            log.error("%s: episode %s of domain %r: %s; counted as a verifier error, never a reward (first "
                      "occurrence of this value%s)", self.name, episode_id, domain, text, more)
        return BadReward(text)


def cap_messages(messages: Sequence[ChatMessage], limit: int) -> tuple[list[ChatMessage], int]:
    """`messages` with at most `limit` characters of content in all (the rest dropped, a marker in its
    place), and how many characters were dropped."""
    out: list[ChatMessage] = []
    left, dropped = limit, 0
    for m in messages:
        if len(m.content) > left:
            cut = len(m.content) - left
            dropped += cut
            m = ChatMessage(role=m.role, name=m.name,
                            content=f"{m.content[:left]}\n(... truncated: {len(m.content)} characters, {cut} dropped)")
            left = 0
        else:
            left -= len(m.content)
        out.append(m)
    return out, dropped


def observation_info(dropped: int) -> dict[str, float]:
    """The reply info that counts a truncation ({} when nothing was dropped)."""
    return {TRUNCATED: 1.0, CHARS_DROPPED: float(dropped)} if dropped else {}


__all__ = ["CHARS_DROPPED", "MAX_LOGGED", "TRUNCATED", "BadReward", "RewardCheck", "cap_messages",
           "observation_info", "source_line"]
