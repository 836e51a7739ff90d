"""Multi-turn samples: the rollout worker's side of an episode, token-in/token-out.

Each sample of an episodic group is one episode, run in an environment process (`tidal.rollout.episodes.pool`).
The worker owns the sample's tokens: the prompt its renderer made from the first observation, then for
each turn the tokens the engine sampled (trained: loss mask 1, the sampler's logprobs and versions) and
the tokens the renderer appended for the environment's answer (not trained: loss mask 0, logprob 0,
version `NO_VERSION`). The next turn is generated from exactly that sequence; nothing is re-tokenised.

When a renderer cannot extend what was sampled (its template renders the history differently), or the
environment sends the whole conversation anew (`EpisodeReply.restart`: an agent that rewrote its history), the
sample closes there and a new segment of the same episode starts from a fresh render (counted as a
split): segment k > 0 has the id ``segment_id(<sample id>, k)`` and the episode's reward, like segment 0.

Each step's reward sits at the completion index where that step's action ended (`Trajectory.step_ends`,
exclusive), and the outcome is `Trajectory.reward`: the two meet only in the advantage estimator
(``grpo_process``). An episode that errs (environment died, timed out, raised; verifier raised) is counted by
kind and never becomes a zero reward; `EpisodesConfig.on_error` says what its group does (`MultiTurn.on_failure`).
An episode that runs out of its token budget is truncated: it ends with reward 0 (counted).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import msgspec
import numpy as np

from tidal.core.arrays import Array
from tidal.core.config import ConfigStruct, Domain, PluginRef
from tidal.core.interfaces import GenerationRequest, GenerationResult, Task
from tidal.core.plugins import registry
from tidal.core.protocol import (
    NO_VERSION,
    Assignment,
    ChatMessage,
    EpisodeReply,
    SamplingParams,
    ToolSpec,
    Trajectory,
    segment_id,
    trajectory_id,
)
from tidal.rollout.engines.stops import split_stops
from tidal.rollout.episodes.pool import EnvPool
from tidal.rollout.episodes.renderers import check_renderer

log = logging.getLogger("tidal.rollout.multiturn")

COUNTERS = ("episodes", "turns", "tool_calls", "tool_errors", "invalid_calls", "step_reward_sum", "splits",
            "truncated", "failed", "retried", "finished_turns", "finished_tool_calls", "finished_tool_errors",
            "renderer_problems")


class EpisodesConfig(ConfigStruct):
    """How the worker runs multi-turn (episodic) domains."""

    renderer: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="plain"))  # `tidal plugins renderer`
    processes: int = 2  # environment processes episodes run in
    # Every limit an episode can meet in its environment process is one of these fields (no hidden ones).
    # An open (episode() and reset()) or a step (the author's tool calls included) that takes longer fails
    # its episode ("timeout"): the process's Python stack goes to its log, the process is killed and
    # restarted, and its other episodes end "env_restarted" (not at fault)
    step_timeout_s: float = 30.0
    # how long an environment process may take to start and build every domain's environment (data,
    # models) before it serves; a start that takes longer counts as a failure of the process
    start_timeout_s: float = 120.0
    # characters of one observation (reset's, or a step's: tool results included) kept; the rest is dropped
    # in the environment process with a marker, and counted (rollout/episodes/info/observations_truncated,
    # .../observation_chars_dropped): the worker never tokenises an unbounded string
    max_observation_chars: int = 16384
    max_tokens: int = 256  # tokens of one sample after its prompt (actions + observations); then truncated
    # local plugin modules (importable, not installed) that the driver, the workers and their environment
    # processes register before building anything: an env under development, a test env
    plugins: list[str] = []
    log_dir: str = ""  # where environment processes log (<worker>-env-<i>.log); "" = a temporary folder
    # what a failed episode does to its group (docs/plugins.md, "When an episode fails"):
    # - "drop_group": the group is not trained on. The default because GRPO's baseline is the group's mean:
    #   when failures correlate with the reward (hard tasks fail more), training on the rest biases it;
    # - "survivors": the group trains on the episodes that finished, when at least `min_survivors` did
    #   (its baseline is then over those), else it is dropped;
    # - "retry": the episode is run again (a new episode id, `<sample id>~r1`), up to `max_retries` times,
    #   then the group is dropped.
    # An episode lost to the infrastructure (`env_died`, `env_restarted`: its process died or was killed for
    # another episode) is retried up to `max_retries` times whatever the choice.
    on_error: Literal["drop_group", "survivors", "retry"] = "drop_group"
    min_survivors: int = 2  # on_error = "survivors": fewer finished episodes than this drop the group
    max_retries: int = 1  # reruns of one sample's episode (on_error = "retry", and infrastructure failures)


@dataclass
class Segment:
    """One trajectory's worth of an episode: a prompt and the completion tokens after it."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # per token the oldest version in the KV cache it attended to (each turn is a fresh request, so the
    # engine rebuilt the history's KV for it and reports it); None once a turn's engine could not tell
    kv_versions: list[int] | None = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    step_ends: list[int] = field(default_factory=list)
    finish: str = ""

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None = None, versions: Sequence[int] | None = None,
            kv_versions: Sequence[int] | None = None) -> None:
        """Append sampled tokens (with their logprobs, versions and KV versions) or, without them, rendered ones."""
        self.ids.extend(ids)
        if logprobs is None:
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([NO_VERSION] * len(ids))
            if self.kv_versions is not None:
                self.kv_versions.extend([NO_VERSION] * len(ids))
            self.mask.extend([0] * len(ids))
        else:
            self.logprobs.extend(logprobs)
            self.versions.extend(versions or [])
            if kv_versions is None:
                self.kv_versions = None
            elif self.kv_versions is not None:
                self.kv_versions.extend(kv_versions)
            self.mask.extend([1] * len(ids))


@dataclass
class EpisodeRun:
    """One sample's episode as the worker drives it."""

    group_id: str
    index: int
    id: str  # the sample's trajectory id, also the episode id the environment process knows
    renderer: Any = None
    segments: list[Segment] = field(default_factory=list)
    conversation: list[ChatMessage] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    max_turns: int = 1
    turns: int = 0  # actions taken (EpisodeStep seq of the last one)
    last_action: list[int] = field(default_factory=list)
    outcome: float | None = None  # set when done
    info: dict[str, float] = field(default_factory=dict)
    retries: int = 0  # how many earlier episodes of this sample failed and were run again
    failed: str = ""  # why it failed, its own text (the group goes on without it: on_error = "survivors")
    turn_versions: list[int] = field(default_factory=list)  # each action's newest policy version (transcripts)

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


# failures of the machinery, not of the author's episode: retried whatever `on_error` says
INFRASTRUCTURE = frozenset({"env_died", "env_restarted"})


class EpisodeFailed(Exception):
    """An episode could not finish: `MultiTurn.on_failure` decides what its group does, the worker goes on.
    `cause` is the failure's own text (the author's, for a verifier error), without the episode id."""

    def __init__(self, group_id: str, reason: str, detail: str, episode_id: str = "") -> None:
        super().__init__(f"episode {episode_id}: {detail}" if episode_id else detail)
        self.group_id, self.reason, self.cause, self.episode_id = group_id, reason, detail, episode_id


class MultiTurn:
    """Runs the episodes of a worker's episodic groups: opens them in the pool, submits each turn to the
    engine, steps the environment with what was sampled, extends the tokens with what it answered."""

    def __init__(self, cfg: EpisodesConfig, pool: Any, engine: Any, tokenizer: Any,
                 make_renderer: Callable[[], Any]) -> None:
        self.cfg, self.pool, self.engine, self.tokenizer = cfg, pool, engine, tokenizer
        self.make_renderer = make_renderer
        self.runs: dict[str, EpisodeRun] = {}  # episode id -> run
        self.by_request: dict[str, str] = {}  # engine request id -> episode id
        self.assignments: dict[str, Assignment] = {}  # group id -> its assignment
        self.tasks: dict[str, Task] = {}  # group id -> its task (a retried episode is opened with it again)
        self.slots: dict[str, list[str]] = {}  # group id -> the episode id each sample now runs under
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.failed_by_kind: dict[str, int] = {}  # failed episodes by kind (env_died, verifier_error, ...)
        self.failed_runs: dict[str, EpisodeRun] = {}  # failed episodes a group goes on without (survivors)
        self.info_sums: dict[str, float] = {}  # step info keys the environment reports beyond COUNTERS
        self._stops: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    # ------------------------------------------------------------------ starting

    def start(self, a: Assignment, task: Task) -> None:
        self.assignments[a.group_id], self.tasks[a.group_id] = a, task
        self.slots[a.group_id] = []
        for i in range(a.num_samples):
            eid = trajectory_id(a.group_id, i)
            self.slots[a.group_id].append(eid)
            self.runs[eid] = EpisodeRun(group_id=a.group_id, index=i, id=eid)
            self.pool.open(eid, a.task, task)

    def owns(self, request_id: str) -> bool:
        return request_id in self.by_request

    # ------------------------------------------------------------------ events

    def on_reply(self, r: EpisodeReply) -> str | None:
        """Handle one environment reply; returns the group id when that group's episodes are all done.
        Raises EpisodeFailed (with the group id in `.group_id`) when the episode failed."""
        run = self.runs.get(r.episode_id)
        if run is None:
            return None  # an episode already dropped
        if r.error or r.error_kind:  # the pool answers each request once: an error ends the episode
            self._fail(run, r.error_kind or "env_error", r.error or "the environment process reported an error")
        if r.seq != run.turns:
            return None  # not the answer to this episode's pending request
        self._count_info(run, r)
        if r.seq == 0:
            run.tools, run.max_turns, run.stop = list(r.tools), max(1, r.max_turns or 1), list(r.stop)
            run.conversation = list(r.messages) if r.text is None else [ChatMessage(role="user", content=r.text)]
            try:
                run.renderer = self.make_renderer()
                prompt = (list(r.token_ids) if r.token_ids is not None else self._encode(r.text)
                          if r.text is not None else run.renderer.start(run.conversation, run.tools))
            except Exception as e:
                self._fail(run, "render_error", f"rendering the first observation failed: {type(e).__name__}: {e}")
            run.segments.append(Segment(prompt=prompt))
            self._generate(run)
            return None
        seg = run.segments[-1]
        seg.step_rewards.append(float(r.reward))
        seg.step_ends.append(len(seg.ids))  # the step ended where its action's tokens end
        self.counters["step_reward_sum"] += float(r.reward)
        if r.done:
            if r.outcome is None:
                self._fail(run, "verifier_error", "the episode ended without an outcome reward")
            run.outcome = float(r.outcome)
            return self._finished(run)
        if run.turns >= run.max_turns:
            return self._truncate(run, f"{run.turns} turns (max_turns) without the episode ending")
        if not self._observe(run, r):
            return self._truncate(run, f"{run.tokens} tokens and an observation that does not fit "
                                       f"(episodes.max_tokens={self.cfg.max_tokens})")
        self._generate(run)
        return None

    def _count_info(self, run: EpisodeRun, r: EpisodeReply) -> None:
        """The reply's counters (the first observation's too: a truncated one is counted there)."""
        for k, v in r.info.items():  # known ones, and the environment's own
            if k in self.counters:
                self.counters[k] += float(v)
            else:
                self.info_sums[k] = self.info_sums.get(k, 0.0) + float(v)
            run.info[k] = run.info.get(k, 0.0) + float(v)

    def on_result(self, res: GenerationResult) -> None:
        """A turn's generation finished: its tokens join the sample, its text goes to the environment."""
        eid = self.by_request.pop(res.request_id, None)
        run = self.runs.get(eid) if eid is not None else None
        if run is None:
            return
        if res.finish_reason == "abort":
            self._fail(run, "abort", "a turn was aborted (partial_mode=drop drops groups caught by a weight update)")
        seg = run.segments[-1]
        seg.add(res.completion_ids, res.logprobs, res.versions, res.kv_versions)
        seg.finish = res.finish_reason
        run.last_action = list(res.completion_ids)
        run.turn_versions.append(max(res.versions, default=NO_VERSION))
        run.turns += 1
        self.counters["turns"] += 1
        try:
            text = self.tokenizer.decode(res.completion_ids, skip_special_tokens=True)
        except Exception as e:
            self._fail(run, "decode_error", f"{type(e).__name__}: {e}")
        run.conversation.append(ChatMessage(role="assistant", content=text))
        self.pool.step(run.id, run.turns, text)

    # ------------------------------------------------------------------ turns

    def _observe(self, run: EpisodeRun, r: EpisodeReply) -> bool:
        """Extend the sample with the environment's answer, or split it where the renderer cannot. False
        when the answer and one more token of action would not fit the sample's budget (the answer is
        then not appended: no action follows it, so nothing would train on it)."""
        seg = run.segments[-1]
        new = list(r.messages) if r.text is None else [ChatMessage(role="user", content=r.text)]
        run.conversation = new if r.restart else [*run.conversation, *new]  # restart: an agent rewrote its history
        try:
            ext = None if r.restart else (list(r.token_ids) if r.token_ids is not None else self._encode(r.text)
                                          if r.text is not None else run.renderer.extend(run.last_action, r.messages))
            if ext is None:
                fresh = self.make_renderer()
                prompt = self._encode(r.text) if r.text is not None else fresh.start(run.conversation, run.tools)
        except Exception as e:  # a renderer (or the tokenizer under it) that cannot write this answer
            self._fail(run, "render_error", f"rendering the environment's answer failed: {type(e).__name__}: {e}")
        if ext is not None:
            if run.tokens + len(ext) >= self.cfg.max_tokens:
                return False
            seg.add(ext)
            return True
        self.counters["splits"] += 1
        run.renderer = fresh
        run.segments.append(Segment(prompt=prompt))
        return True

    def _encode(self, text: str | None) -> list[int]:
        """A plain-text observation's tokens, as it is (nothing before it is tokenised again)."""
        return list(self.tokenizer.encode(text or "", add_special_tokens=False))

    def _generate(self, run: EpisodeRun) -> None:
        a = self.assignments[run.group_id]
        seg = run.segments[-1]
        budget = self.cfg.max_tokens - run.tokens
        p = a.sampling
        stops = [*p.stop, *run.renderer.stop, *run.stop] if run.renderer is not None else list(p.stop)
        stop_ids, stop_strings = self._split_stops(stops)
        # each turn's seed from the sample's (as single-turn samples have) and the turn: reproducible
        base = p.seed + run.index if p.seed is not None else zlib.crc32(run.id.encode())
        sampling = msgspec.structs.replace(
            p, max_tokens=max(1, min(p.max_tokens, budget)), stop=stop_strings,
            stop_token_ids=sorted({*p.stop_token_ids, *stop_ids}), seed=(base + 7919 * run.turns) & 0x7FFFFFFF)
        request_id = f"{run.id}/{run.turns}"
        self.by_request[request_id] = run.id
        self.engine.submit(GenerationRequest(request_id=request_id, prompt_ids=[*seg.prompt, *seg.ids],
                                             sampling=sampling))

    def _split_stops(self, stops: list[str]) -> tuple[list[int], list[str]]:
        """(stop token ids, stop strings), once per distinct set: every turn of every sample asks."""
        key = tuple(dict.fromkeys(stops))
        if key not in self._stops:
            self._stops[key] = split_stops(self.tokenizer, key)
        return self._stops[key]

    # ------------------------------------------------------------------ endings

    def _finished(self, run: EpisodeRun) -> str | None:
        self.pool.close_episode(run.id)
        self.counters["episodes"] += 1
        # per-episode rates count an ended episode's turns and calls together (the running counters above
        # count calls as they happen: a window's ratio of the two would mix episodes of two windows)
        self.counters["finished_turns"] += run.turns
        self.counters["finished_tool_calls"] += run.info.get("tool_calls", 0.0)
        self.counters["finished_tool_errors"] += run.info.get("tool_errors", 0.0)
        return run.group_id if self._complete(run.group_id) else None

    def _complete(self, group_id: str) -> bool:
        """Every sample of the group has ended: finished, truncated, or failed for good."""
        runs = [self.runs.get(eid) or self.failed_runs.get(eid) for eid in self.slots[group_id]]
        return all(r is not None and (r.done or r.failed) for r in runs)

    def _truncate(self, run: EpisodeRun, why: str) -> str | None:
        self.counters["truncated"] += 1
        run.segments[-1].finish = "truncated"
        run.outcome = 0.0
        log.debug("episode %s truncated after %s", run.id, why)
        return self._finished(run)

    def _fail(self, run: EpisodeRun, reason: str, detail: str) -> NoReturn:
        raise EpisodeFailed(run.group_id, reason, detail, run.id)

    # ------------------------------------------------------------------ failures

    def on_failure(self, e: EpisodeFailed) -> Literal["retried", "waiting", "complete", "drop"]:
        """What a failed episode means for its group (counted here, by kind): "retried" (a new episode of
        the same sample runs), "waiting" (the group goes on without it; others still run), "complete" (the
        group's other episodes have all ended: deliver its survivors), "drop" (the group cannot train)."""
        run = self.runs.get(e.episode_id)
        if run is None or e.group_id not in self.assignments:
            return "drop"  # an episode of a group already settled
        self.counters["failed"] += 1
        self.failed_by_kind[e.reason] = self.failed_by_kind.get(e.reason, 0) + 1
        self._stop_episode(run)
        cfg = self.cfg
        if run.retries < cfg.max_retries and (cfg.on_error == "retry" or e.reason in INFRASTRUCTURE):
            self._retry(run)
            return "retried"
        run.failed = e.cause or e.reason
        self.failed_runs[run.id] = run
        if cfg.on_error != "survivors":
            return "drop"
        alive = sum(1 for eid in self.slots[e.group_id] if not self._slot_run(eid).failed)
        if alive < max(cfg.min_survivors, 1):
            return "drop"
        return "complete" if self._complete(e.group_id) else "waiting"

    def _retry(self, run: EpisodeRun) -> None:
        """The sample's episode again, under a new id (the environment process and the buffer never see
        one episode id twice): ``<sample id>~r<k>``."""
        sample = trajectory_id(run.group_id, run.index)
        retry = EpisodeRun(group_id=run.group_id, index=run.index, id=f"{sample}~r{run.retries + 1}",
                           retries=run.retries + 1)
        self.counters["retried"] += 1
        self.slots[run.group_id][run.index] = retry.id
        self.runs[retry.id] = retry
        a = self.assignments[run.group_id]
        self.pool.open(retry.id, a.task, self.tasks[run.group_id])

    def _stop_episode(self, run: EpisodeRun) -> None:
        """A failed episode leaves the pool and the engine (its process may hold it; a turn may be running)."""
        self.runs.pop(run.id, None)
        self.pool.close_episode(run.id)
        for rid in [rid for rid, eid in self.by_request.items() if eid == run.id]:
            del self.by_request[rid]
            self.engine.abort([rid])

    def left_out(self, group_id: str) -> list[str]:
        """Why each failed sample of a group was left out (the failure's own text), in sample order."""
        return [f for f in (self._slot_run(eid).failed for eid in self.slots.get(group_id, [])) if f]

    def _slot_run(self, eid: str) -> EpisodeRun:
        return self.runs.get(eid) or self.failed_runs[eid]

    def forget(self, group_id: str) -> None:
        """Drop a group's episodes (failed, delivered or abandoned): close the live ones in the pool."""
        a = self.assignments.pop(group_id, None)
        self.tasks.pop(group_id, None)
        if a is None:
            return
        for eid in self.slots.pop(group_id, []):
            self.failed_runs.pop(eid, None)
            run = self.runs.pop(eid, None)
            if run is not None and not run.done:
                self.pool.close_episode(run.id)
        for rid in [rid for rid, eid in self.by_request.items() if eid.startswith(group_id + ":")]:
            del self.by_request[rid]
            self.engine.abort([rid])

    # ------------------------------------------------------------------ delivery

    def trajectories(self, group_id: str, source: str) -> list[Trajectory]:
        """Every segment of every episode of a finished group, as trajectories (group_size = their count)."""
        a = self.assignments[group_id]
        out: list[Trajectory] = []
        for eid in self.slots[group_id]:
            run = self._slot_run(eid)
            if run.failed:  # left out: the group's baseline is over the episodes that finished
                continue
            for k, seg in enumerate(run.segments):
                out.append(_trajectory(a, run, k, seg, source))
        for t in out:
            t.group_size = len(out)
        return out

    def metrics(self) -> dict[str, float]:
        c, n = self.counters, max(self.counters["episodes"], 1.0)
        out = {f"rollout/episodes/{k}": v for k, v in c.items()}
        out.update({
            "rollout/episodes/turns_per_episode": c["finished_turns"] / n,  # of the episodes that ended
            "rollout/episodes/tool_calls_per_episode": c["finished_tool_calls"] / n,
            "rollout/episodes/tool_error_rate": c["finished_tool_errors"] / max(c["finished_tool_calls"], 1.0),
            "rollout/episodes/step_reward_mean": c["step_reward_sum"] / max(c["turns"], 1.0),
            **{f"rollout/episodes/failed/{r}": float(v) for r, v in self.failed_by_kind.items()},
            **{f"rollout/episodes/info/{k}": v for k, v in self.info_sums.items()},
        })
        out.update({f"rollout/envpool/{k}": float(v) for k, v in self.pool.counters.items()})
        return out


def _arr(values: Sequence[Any], dtype: Any) -> Array:
    return Array.from_numpy(np.asarray(values, dtype))


def _trajectory(a: Assignment, run: EpisodeRun, k: int, seg: Segment, source: str) -> Trajectory:
    info = {f"tidal.episode.{name}": f"{v:g}" for name, v in run.info.items()}
    return Trajectory(
        id=segment_id(run.id, k), group_id=a.group_id, sample_index=run.index, task=a.task,
        prompt_ids=_arr(seg.prompt, np.int32), completion_ids=_arr(seg.ids, np.int32),
        logprobs=_arr(seg.logprobs, np.float32), versions=_arr(seg.versions, np.int32),
        kv_versions=None if seg.kv_versions is None else _arr(seg.kv_versions, np.int32),
        reward=float(run.outcome or 0.0), finish_reason=seg.finish or "stop",
        step_rewards=_arr(seg.step_rewards, np.float32), step_ends=_arr(seg.step_ends, np.int32),
        loss_mask=_arr(seg.mask, np.uint8),
        metadata={**a.metadata, **info, "tidal.episode.turns": str(run.turns), "tidal.episode.segment": str(k)},
        source=source, sampling=a.sampling,
    )


def start_multiturn(worker: str, cfg: EpisodesConfig, domains: Sequence[Domain], engine: Any,
                    tokenizer: Any) -> MultiTurn:
    """A rollout worker's multi-turn driver: its environment processes started (serving the worker's
    `domains`), its renderer built per sample, checked once."""
    pool = EnvPool(domains, processes=cfg.processes, step_timeout_s=cfg.step_timeout_s, plugins=cfg.plugins,
                   name=f"{worker}-env", log_dir=cfg.log_dir or None, start_timeout_s=cfg.start_timeout_s,
                   max_observation_chars=cfg.max_observation_chars)
    # not waiting for their Hello: they build every domain's environment first, which may take longer than
    # the worker may go without a heartbeat; episodes opened meanwhile wait in the pool's queue
    pool.start(wait=False)

    def make() -> Any:
        return registry.build("renderer", cfg.renderer.name, cfg.renderer.options, tokenizer, field="episodes.renderer")

    mt = MultiTurn(cfg, pool, engine, tokenizer, make)
    _check_renderer(worker, cfg.renderer.name, mt, make, tokenizer)
    return mt


def _check_renderer(worker: str, name: str, mt: MultiTurn, make: Callable[[], Any], tokenizer: Any) -> None:
    """The startup check: does the renderer extend sampled tokens exactly for this model's tokenizer?
    Where it cannot, samples split (counted); where the tokenizer would merge tokens differently across
    a turn boundary, the model sees token sequences it never saw in one piece. Either is logged once."""
    try:
        problems = check_renderer(make, tokenizer)
    except Exception as e:  # a tokenizer that cannot encode the probe conversation (a narrow alphabet)
        log.info("%s: renderer %r not checked (its probe conversation does not encode: %s)", worker, name, e)
        return
    mt.counters["renderer_problems"] = float(len(problems))
    for p in problems:
        log.warning("%s: renderer %r with this model's tokenizer: %s", worker, name, p)


def run_episodes(engine: Any, tokenizer: Any, pool: Any, domain: str, tasks: Sequence[Task], sampling: SamplingParams,
                 cfg: EpisodesConfig, make_renderer: Callable[[], Any], timeout: float = 600.0) -> list[EpisodeRun | None]:
    """Play one episode per task to its end (evaluation: the demo's warm-start accuracy); None where the
    episode failed. The engine and the pool are the caller's; nothing is trained."""
    mt = MultiTurn(cfg, pool, engine, tokenizer, make_renderer)
    groups = [f"local-{i:05d}" for i in range(len(tasks))]
    for gid, task in zip(groups, tasks, strict=True):
        mt.start(Assignment(group_id=gid, prompt_ids=_arr([], np.int32), num_samples=1, task=domain,
                            sampling=sampling, prompt=task.prompt, answer=task.answer), task)
    pending, failed = set(groups), set()
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} of {len(tasks)} episodes unfinished after {timeout:g} s")
        for reply in pool.poll(timeout=0):
            try:
                finished = mt.on_reply(reply)
            except EpisodeFailed as e:
                finished = e.group_id
                failed.add(finished)
            if finished is not None:
                pending.discard(finished)
        for res in engine.poll(timeout=0.01):
            try:
                mt.on_result(res)
            except EpisodeFailed as e:
                failed.add(e.group_id)
                pending.discard(e.group_id)
    return [None if gid in failed else mt.runs[trajectory_id(gid, 0)] for gid in groups]


__all__ = ["EpisodeFailed", "EpisodeRun", "EpisodesConfig", "MultiTurn", "Segment", "run_episodes", "start_multiturn"]
