"""`checkpoints/best`: the kept checkpoint of the best evaluated version, pinned by the driver.

The driver evaluates, the learner checkpoints; neither knows the other's numbers. When an evaluation of
version v beats every earlier one, the driver links the checkpoint holding v (if one is kept) as
`best`. No torch here: the driver imports this on its first evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def link(src: str, dst: str) -> None:
    """A hard link of `src` at `dst` (no second copy on disk); a copy on a file system without them."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _progress_version(path: Path) -> int | None:
    try:
        return int(json.loads((path / "progress.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, or being replaced by the learner
        return None


def pin_best(checkpoint_dir: str | Path, version: int) -> Path | None:
    """Make `<checkpoint_dir>/best` a copy (hard links) of the kept checkpoint holding policy `version`
    (`latest` when its progress.json says so, else `step-<version>`); the driver calls it when an
    evaluation of `version` beats every earlier one. None when no kept checkpoint holds `version`
    (learner.checkpoint_every does not divide it) or the learner replaced it while it was linked."""
    root = Path(checkpoint_dir)
    sources = [root / "latest", root / f"step-{version:06d}"]
    src = next((p for p in sources if _progress_version(p) == version), None)
    if src is None:
        return None
    tmp, best, old = root / ".best-tmp", root / "best", root / ".best-old"
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)

    try:
        shutil.copytree(src, tmp, copy_function=link)
    except (OSError, shutil.Error):  # the learner renamed or removed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    if _progress_version(tmp) != version or _progress_version(src) != version:
        shutil.rmtree(tmp)  # the learner rewrote it between our look and our links: a mixed copy
        return None
    if best.exists():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    return best
