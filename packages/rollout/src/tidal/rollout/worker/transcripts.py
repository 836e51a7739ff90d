"""What the model wrote: a sample of transcripts a rollout worker writes to the run folder.

A worker appends one JSON line per sample to ``<dir>/<worker>.jsonl``: every sample of every Nth group it
finishes (``every``), and every episode that failed or was split (``failed``), so that an environment
author can read what the model saw and answered without a debugger. `tidal samples RUN_DIR` prints them.

A line (``kind`` "episode" for multi-turn domains, "single" otherwise)::

    {"time", "worker", "kind", "domain", "group_id", "episode_id", "version", "versions": [min, max],
     "reward", "failed", "error_kind", "error", "segments", "finish",
     "messages": [{"role", "text", "name"?, "tool_calls"?, "reward"?, "version"?}, ...]}

``messages`` is the conversation as rendered text: the environment's first observation, then each action
(role "assistant", with the step reward, the policy version that wrote it and the tools its observation
answered) and the observation that answered it (roles "user" or "tool"). ``reward`` is the final reward
(None for a failed episode); ``version`` is the newest policy version among the sampled tokens.

Every text is cut to ``max_chars_per_message``; the file stops growing at ``max_mb`` (said once in the log).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from tidal.core.config import ConfigStruct
from tidal.core.protocol import NO_VERSION, trajectory_id

log = logging.getLogger("tidal.rollout.transcripts")


class TranscriptsConfig(ConfigStruct):
    """Which samples a rollout worker writes as readable transcripts (`tidal samples RUN_DIR` shows them)."""

    every: int = 10  # every sample of every Nth finished group (the first included); 0 = none
    failed: bool = True  # also every episode that failed (with its error) or was split by the renderer
    max_mb: float = 20.0  # per worker: the file stops growing here (logged once)
    max_chars_per_message: int = 4000  # longer texts are cut, marked with how much was left out
    dir: str = ""  # where <worker>.jsonl goes; "" = <run_dir>/samples under `tidal run`, none otherwise


class TranscriptWriter:
    """Appends transcripts to ``<dir>/<worker>.jsonl`` within the configured caps."""

    def __init__(self, cfg: TranscriptsConfig, worker: str) -> None:
        self.cfg, self.worker = cfg, worker
        self.path = Path(cfg.dir) / f"{worker}.jsonl" if cfg.dir else None
        self.groups = 0  # finished groups seen (the Nth-group count)
        self.written = 0  # records written
        self.full = False
        self._bytes = self.path.stat().st_size if self.path is not None and self.path.exists() else 0
        self._f: Any = None

    @property
    def enabled(self) -> bool:
        return self.path is not None and not self.full

    def take_group(self) -> bool:
        """Count one finished group; True when its samples are to be written (every Nth, the first included)."""
        n, self.groups = self.groups, self.groups + 1
        return self.enabled and self.cfg.every > 0 and n % self.cfg.every == 0

    def wants_failure(self) -> bool:
        return self.enabled and self.cfg.failed

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record (its texts cut to the per-message cap); False once the size cap is reached."""
        if not self.enabled:
            return False
        assert self.path is not None  # enabled
        line = msgspec.json.encode(self._cut(record)) + b"\n"
        if self._bytes + len(line) > self.cfg.max_mb * 1e6:
            self.full = True
            log.warning("%s: transcripts stop at %s (%.0f MB, rollout.transcripts.max_mb); %d written", self.worker,
                        self.path, self._bytes / 1e6, self.written)
            return False
        try:
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "ab")
            self._f.write(line)
            self._f.flush()  # a worker killed later keeps what it wrote
        except OSError as e:  # a full disk or a folder it may not write costs the transcripts, not the worker
            self.full = True
            log.error("%s: transcripts stop: cannot write %s: %s", self.worker, self.path, e)
            return False
        self._bytes += len(line)
        self.written += 1
        return True

    def write_single(self, a: Any, results: dict[int, Any], text: Any, rewards: list[float] | None,
                     error_kind: str = "", error: str = "") -> None:
        """Every sample of single-turn assignment `a` (`rewards` None: a group that could not be scored,
        and why); `text` decodes token ids."""
        prompt = a.prompt or text([int(x) for x in a.prompt_ids.numpy()])
        for i in range(a.num_samples):
            res = results[i]
            self.write(single_record(self.worker, a.task, a.group_id, trajectory_id(a.group_id, i), prompt,
                                     text(res.completion_ids), rewards[i] if rewards is not None else None,
                                     res.versions, res.finish_reason, error_kind, error))

    def write_episodes(self, a: Any, runs: dict[str, Any]) -> None:
        """Every episode of every Nth group; split ones always (when `failed` is on: the renderer's seams)."""
        every = self.take_group()
        for i in range(a.num_samples):
            run = runs.get(trajectory_id(a.group_id, i))
            if run is not None and (every or (len(run.segments) > 1 and self.wants_failure())):
                self.write(episode_record(run, self.worker, a.task))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def _cut(self, record: dict[str, Any]) -> dict[str, Any]:
        n = self.cfg.max_chars_per_message
        out = {**record, "error": cut(record.get("error", ""), n)}
        out["messages"] = [{**m, "text": cut(m.get("text", ""), n)} for m in record.get("messages", [])]
        return out


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters, saying how many were left out."""
    if limit <= 0 or len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def _span(versions: Sequence[int]) -> tuple[int, int] | None:
    vs = [int(v) for v in versions if int(v) != NO_VERSION]
    return (min(vs), max(vs)) if vs else None


def _base(worker: str, kind: str, domain: str, group_id: str, episode_id: str, span: tuple[int, int] | None) -> dict:
    return {"time": time.time(), "worker": worker, "kind": kind, "domain": domain, "group_id": group_id,
            "episode_id": episode_id, "version": span[1] if span else None, "versions": list(span) if span else None}


def episode_record(run: Any, worker: str, domain: str, error_kind: str = "", error: str = "") -> dict[str, Any]:
    """The transcript of one multi-turn episode (a `tidal.rollout.episodes.multiturn.EpisodeRun`), finished or failed."""
    rewards = [r for seg in run.segments for r in seg.step_rewards]
    versions = list(getattr(run, "turn_versions", []))
    span = _span([v for seg in run.segments for v in seg.versions])
    messages: list[dict[str, Any]] = []
    action = None  # the last assistant message: the tools of the observation that answers it go there
    turn = 0
    for m in run.conversation:
        msg: dict[str, Any] = {"role": m.role, "text": m.content}
        if m.name:
            msg["name"] = m.name
        if m.role == "assistant":
            if turn < len(rewards):
                msg["reward"] = rewards[turn]
            if turn < len(versions):
                msg["version"] = versions[turn]
            turn += 1
            action = msg
        elif m.role == "tool" and action is not None:
            action.setdefault("tool_calls", []).append(m.name or "tool")
        messages.append(msg)
    failed = bool(error_kind or error)
    finish = "failed" if failed else (run.segments[-1].finish if run.segments else "")
    return {**_base(worker, "episode", domain, run.group_id, run.id, span),
            "reward": None if failed else run.outcome, "failed": failed, "error_kind": error_kind, "error": error,
            "segments": len(run.segments), "finish": finish, "messages": messages}


def single_record(worker: str, domain: str, group_id: str, sample_id: str, prompt: str, completion: str,
                  reward: float | None, versions: Sequence[int], finish: str, error_kind: str = "",
                  error: str = "") -> dict[str, Any]:
    """The transcript of one single-turn sample: the prompt, what the model answered, its reward (None
    for a sample of a group that could not be scored: `error_kind` and `error` say why)."""
    span = _span(versions)
    answer: dict[str, Any] = {"role": "assistant", "text": completion}
    if reward is not None:
        answer["reward"] = reward
    if span:
        answer["version"] = span[1]
    failed = bool(error_kind or error)
    return {**_base(worker, "single", domain, group_id, sample_id, span), "reward": reward, "failed": failed,
            "error_kind": error_kind, "error": error, "segments": 1, "finish": "failed" if failed else finish,
            "messages": [{"role": "user", "text": prompt}, answer]}


__all__ = ["TranscriptWriter", "TranscriptsConfig", "cut", "episode_record", "single_record"]
