"""A plugin that fails to build, told in one line: the recipe field, the plugin, its module and
distribution, the error, and the line of the author's code that raised it.

An environment that imports a missing dependency inside its factory otherwise shows a 40-line traceback
through the registry, the driver and importlib, with the author's line somewhere in the middle.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Callable
from types import TracebackType
from typing import Any

import tidal
from tidal.core.errors import ConfigError

# how a kind reads in a sentence ("environment plugin 'unitconv'"); the rest read as their kind name
_KIND_WORDS = {"env": "environment", "tool_parser": "tool-call parser", "weight_transport": "weight transport"}


class PluginBuildError(ConfigError):
    """A plugin's factory raised while building it (a missing dependency imported lazily, a bug in its
    constructor). The message names the field, the plugin, its module and distribution, the error and the
    author's file and line; `where` is that ``file:line`` ("" when no frame of the author's was found)."""

    def __init__(self, message: str, *, field: str | None = None, where: str = "") -> None:
        super().__init__(message, field=field)
        self.where = where


def build_failure(kind: str, name: str, factory: Callable[..., Any], error: BaseException, *, field: str = "",
                  doing: str = "build") -> PluginBuildError:
    """The `PluginBuildError` for `error`, raised by plugin `name` of `kind` (built from `factory`) while it
    was doing `doing` ("build", "make its first train task")."""
    module = getattr(factory, "__module__", "") or "?"
    dist = distribution_of(module)
    origin = f"module {module}" + (f", distribution {dist}" if dist else "")
    where = author_frame(error.__traceback__, module.split(".")[0])
    at = f" ({where})" if where else ""
    head = f"{field}: " if field else ""
    word = _KIND_WORDS.get(kind, kind)
    return PluginBuildError(f"{head}{word} plugin {name!r} ({origin}) failed to {doing}: "
                            f"{type(error).__name__}: {error}{at}", field=field or None, where=where)


def distribution_of(module: str) -> str:
    """The installed distribution that ships `module`'s top-level package; "" when none does (a module on
    PYTHONPATH, `rollout.episodes.plugins`)."""
    try:
        names = importlib.metadata.packages_distributions().get(module.split(".")[0], [])
    except Exception:  # a broken distribution's metadata must not hide the error being reported
        return ""
    return ", ".join(sorted(set(names)))


def author_frame(tb: TracebackType | None, package: str = "") -> str:
    """``path:line`` of the deepest frame in `package` (the plugin's own top-level package); when none, of
    the deepest frame outside Tidal and the standard library. Paths are relative to their import root
    (``unitconv_tidal/pint_backend.py:4``), as an author reads them in their own tree."""
    frames: list[tuple[str, int]] = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    own = [f for f in frames if package and _in_package(f[0], package)]
    outside = [f for f in frames if not _ours(f[0])]
    chosen = own or outside
    if not chosen:
        return ""
    path, line = chosen[-1]
    return f"{_relative(path)}:{line}"


def _in_package(path: str, package: str) -> bool:
    return f"{os.sep}{package}{os.sep}" in path or path.endswith(f"{os.sep}{package}.py")


def _ours(path: str) -> bool:
    """Tidal's own code, the standard library, or frozen import machinery (``<frozen importlib._bootstrap>``)."""
    if path.startswith("<"):
        return True
    real = os.path.realpath(path)
    return any(real.startswith(root + os.sep) for root in _skipped_roots())


def _skipped_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["platstdlib"], *getattr(tidal, "__path__", [])]
    return [os.path.realpath(r) for r in roots]


def _relative(path: str) -> str:
    real = os.path.realpath(path)
    roots = sorted((os.path.realpath(p) for p in sys.path if p), key=len, reverse=True)
    for root in roots:
        if real.startswith(root + os.sep):
            return os.path.relpath(real, root)
    return path


__all__ = ["PluginBuildError", "author_frame", "build_failure", "distribution_of"]
