"""`tidal samples RUN_DIR`: the transcripts the rollout workers wrote (`tidal.rollout.worker.transcripts`), printed
readably, filtered by policy version, domain or failure; also their place in TensorBoard and the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

NONE_WRITTEN = ("no transcripts in {dir}: workers write them under `tidal run` (every Nth group, "
                "rollout.transcripts.every, default 10; failed and split episodes, rollout.transcripts.failed); "
                "check that they are not turned off (every=0, failed=false) and that the run finished a group")


def samples_dir(run_dir: str | Path) -> Path:
    """Where a run's workers wrote transcripts: the recipe's `rollout.transcripts.dir`, else RUN_DIR/samples."""
    run_dir = Path(run_dir)
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        configured = cfg.get("rollout", {}).get("transcripts", {}).get("dir", "")
    except (OSError, ValueError, AttributeError):
        configured = ""
    return Path(configured) if configured else run_dir / "samples"


def read_samples(folder: Path) -> list[dict[str, Any]]:
    """Every record of every worker's file, oldest first (a line cut by a crash is skipped)."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_bytes().splitlines():
            try:
                rows.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                continue
    rows.sort(key=lambda r: r.get("time", 0.0))
    return rows


def select(rows: list[dict[str, Any]], version: int | None = None, domain: str | None = None,
           failed: bool = False, n: int = 5) -> list[dict[str, Any]]:
    """The last `n` records that match: written (any of their tokens) by policy `version`, of `domain`,
    failed ones only."""
    def keep(r: dict[str, Any]) -> bool:
        span = r.get("versions") or [None, None]
        return ((version is None or (span[0] is not None and span[0] <= version <= span[1]))
                and (domain is None or r.get("domain") == domain) and (not failed or bool(r.get("failed"))))

    out = [r for r in rows if keep(r)]
    return out[-n:] if n > 0 else out


def header(r: dict[str, Any]) -> str:
    reward = r.get("reward")
    parts = [f"[{r.get('domain', '?')}]", f"version {r.get('version')}",
             f"reward {reward:g}" if isinstance(reward, (int, float)) else "reward -",
             f"episode {r.get('episode_id', '?')}"]
    if r.get("segments", 1) > 1:
        parts.append(f"{r['segments']} segments (split)")
    if r.get("finish") and r.get("finish") not in ("stop", "failed"):
        parts.append(f"finish {r['finish']}")
    if r.get("failed"):
        parts.append(f"FAILED {r.get('error_kind', '')}: {r.get('error', '')}")
    return "  ".join(parts)


def message_lines(m: dict[str, Any]) -> list[str]:
    """One message: `role:` and its text (indented where it runs over lines), then the tools it called and
    its step reward."""
    role = m.get("role", "?")
    label = f"{role}[{m['name']}]" if role == "tool" and m.get("name") else role
    text = m.get("text", "").rstrip("\n").splitlines() or [""]
    lines = [f"  {label}: {text[0]}", *(f"      {t}" for t in text[1:])]
    for name in m.get("tool_calls", []):
        lines.append(f"      → {name}(...)")
    extra = [f"step reward {m['reward']:g}" if "reward" in m else "", f"v{m['version']}" if "version" in m else ""]
    if any(extra):
        lines.append("      (" + ", ".join(e for e in extra if e) + ")")
    return lines


def format_record(r: dict[str, Any]) -> str:
    return "\n".join([header(r), *(line for m in r.get("messages", []) for line in message_lines(m))])


def show(run_dir: str | Path, version: int | None = None, domain: str | None = None, failed: bool = False,
         n: int = 5, as_json: bool = False) -> tuple[int, str]:
    """(exit status, text) of `tidal samples`."""
    folder = samples_dir(run_dir)
    rows = read_samples(folder)
    if not rows:
        return 1, NONE_WRITTEN.format(dir=folder)
    picked = select(rows, version, domain, failed, n)
    if not picked:
        domains = sorted({str(r.get("domain")) for r in rows})
        return 1, (f"none of the {len(rows)} transcripts in {folder} match (domains: {', '.join(domains)}; "
                   f"{sum(1 for r in rows if r.get('failed'))} failed)")
    if as_json:
        return 0, "\n".join(json.dumps(r) for r in picked)
    return 0, "\n\n".join(format_record(r) for r in picked)


def to_tensorboard(tb: Any, run_dir: str | Path, step: int, per_domain: int = 3) -> int:
    """The last few transcripts of each domain as TensorBoard text (`samples/<domain>`); how many."""
    rows = read_samples(samples_dir(run_dir))
    count = 0
    for domain in sorted({str(r.get("domain")) for r in rows}):
        picked = select(rows, domain=domain, n=per_domain)
        # markdown: a code block keeps the transcript's own line breaks and indentation
        tb.add_text(f"samples/{domain}", "\n\n".join(f"```\n{format_record(r)}\n```" for r in picked), step)
        count += len(picked)
    return count


def summary(run_dir: str | Path) -> dict[str, Any]:
    """Where the transcripts are and how many (the report's summary.json)."""
    folder = samples_dir(run_dir)
    rows = read_samples(folder)
    return {"dir": str(folder), "count": len(rows), "failed": sum(1 for r in rows if r.get("failed")),
            "command": f"tidal samples {run_dir}"}


__all__ = ["format_record", "read_samples", "samples_dir", "select", "show", "summary", "to_tensorboard"]
