"""tidal.textarena: TextArena's two-player games as Tidal multi-role episodes (plugin env ``textarena``).
Names are imported lazily, so importing the package (or scanning its plugin) never imports textarena.
"""

from __future__ import annotations

from tidal.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "DOMAIN": "env",
    "ROLES": "env",
    "TextArenaEnv": "env",
    "TextArenaEpisode": "env",
    "SCRIPTED": "titles",
    "TITLES": "titles",
    "Title": "titles",
    "random_player": "titles",
    "supported_games": "titles",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
