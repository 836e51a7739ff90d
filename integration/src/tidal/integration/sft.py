"""Supervised warm start: teach a fresh model the task's format (and a little of its substance) before RL.

RL only improves what a policy sometimes gets right, so the demo first fits a few hundred steps of
teacher-forced cross-entropy on `prompt -> answer + "\\n"` pairs from an environment's train split, with
the loss on the answer tokens only, packed without padding like the learner packs. Held-out problems are
never seen: the environments split train/eval by prompt hash.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import itertools
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

import tidal.rollout
from tidal.core.config import Domain, PluginRef
from tidal.core.errors import ConfigError
from tidal.core.interfaces import GenerationRequest
from tidal.core.plugins import registry
from tidal.core.protocol import SamplingParams
from tidal.integration.learner.backends import has_sinks
from tidal.rollout.engines.common import generate
from tidal.rollout.engines.embedded import EmbeddedEngine
from tidal.rollout.engines.stops import split_stops
from tidal.rollout.envs.tasks import first_tasks
from tidal.rollout.episodes.local import LocalEpisodes
from tidal.rollout.episodes.multiturn import EpisodesConfig, run_episodes
from tidal.rollout.tiny import load_tokenizer

log = logging.getLogger("tidal.sft")


@dataclass
class SFTConfig:
    steps: int = 300  # optimizer steps
    batch: int = 64  # problems per step
    lr: float = 3e-3  # AdamW peak learning rate (cosine to 10 %, 20-step warm-up)
    weight_decay: float = 0.0
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # An imperfect demonstrator: with this probability a demonstration of an addition that carries
    # (metadata "carry") forgets the carry (47+5= answered 42). The demo uses it so the warm start is
    # right on some problems and sometimes right on the rest: RL, rewarded by the exact answer, fixes it.
    carry_slip: float = 0.0


# A demonstrator shows one task as text segments, each marked trained (written by the model) or not
# (the prompt, an environment's or a tool's answer): the loss covers the trained segments only.
Demonstrator = Callable[[Any, random.Random], list[tuple[str, bool]]]


def answer_demonstrator(cfg: SFTConfig, end: str = "\n") -> Demonstrator:
    """Single-turn: the prompt, then the reference answer and `end` (the run's stop string), with the carry
    slip, if set. A task without a reference answer is a ConfigError (there is nothing to fit)."""

    def show(task: Any, rng: random.Random) -> list[tuple[str, bool]]:
        shown = getattr(task, "answer", "")
        if not shown:
            raise ConfigError("the environment's tasks carry no reference answer (Task.answer) to fit: give "
                              "demonstrations as JSONL instead (tidal sft RECIPE --data FILE.jsonl)",
                              field="domains[0].env")
        if cfg.carry_slip and task.metadata.get("carry") == "1" and rng.random() < cfg.carry_slip:
            shown = str(int(task.answer) - 10)
        return [(task.prompt, False), (shown + end, True)]

    return show


def sft(model_path: str | Path, out: str | Path, env, cfg: SFTConfig,
        progress: Callable[[int, float], None] | None = None,
        demonstrate: Demonstrator | None = None) -> dict[str, float]:
    """Fit `model_path` on `env`'s train split and save the result (model + tokenizer) to `out`.
    `demonstrate(task, rng)` gives each task's text segments (trained or not); default: the prompt, then
    the reference answer. Returns {"loss": final loss, "seconds": wall time, "examples": problems seen}."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(model_path)
    model = _load_model(model_path)
    model.train()
    opt, sched = _optimizer(model, cfg)
    tasks = env.tasks("train", cfg.seed)
    rng = random.Random(cfg.seed + 1)
    show = demonstrate or answer_demonstrator(cfg)
    t0, loss_value = time.perf_counter(), float("nan")
    for step in range(cfg.steps):
        input_ids, position_ids, target = _packed_batch(tok, itertools.islice(tasks, cfg.batch), show, rng)
        # use_cache=False: with a cache transformers ignores the packing in the position ids
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if progress is not None:
            progress(step + 1, loss_value)
    model.eval()
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    seconds = time.perf_counter() - t0
    log.info("SFT: %d steps, final loss %.4f, %.1f s", cfg.steps, loss_value, seconds)
    return {"loss": loss_value, "seconds": seconds, "examples": float(cfg.steps * cfg.batch)}


def built_once(root: str | Path, key: dict[str, Any], build: Callable[[Path], Any]) -> Path:
    """The folder `build(folder)` fills (a warm-started model, say), built once per `key` under `root` and
    reused by every process that asks for it after (side-by-side test workers wait for the first one).
    The cache cannot go stale: its name is a hash of `key`, the source of `build`, the source files of the
    code that builds models, tokenizers, tasks and warm starts (tidal.rollout, this module) and the torch and
    transformers versions; a change to any of them builds a new folder."""
    h = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
    h.update(inspect.getsource(build).encode())
    h.update(f"{torch.__version__} {transformers.__version__}".encode())
    for folder in tidal.rollout.__path__:
        for f in sorted(Path(folder).rglob("*.py")):
            h.update(f.read_bytes())
    h.update(Path(__file__).read_bytes())
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / h.hexdigest()[:20]
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here for the first one's build
        if not (final / ".complete").exists():
            shutil.rmtree(final, ignore_errors=True)  # a build that died half-way
            build(final)
            (final / ".complete").write_text(json.dumps(key, sort_keys=True, default=str))
    return final


def _load_model(model_path: str | Path) -> Any:
    # heavy: transformers (seconds to import); only loading a model needs it
    from transformers import AutoModelForCausalLM

    extra = {}
    if has_sinks(str(model_path)):
        # GPT-OSS: transformers' eager attention (the only one it has on CPU that takes sinks) ignores the
        # packing in the position ids and would attend across the packed problems; tidal_varlen honours both
        from tidal.seqpar.hf import register_varlen_attention

        extra["attn_implementation"] = register_varlen_attention()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **extra)


def _optimizer(model: torch.nn.Module, cfg: SFTConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warm-up over min(20, steps / 10 + 1) steps, then a cosine down to 10 %."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warmup = min(20, cfg.steps // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def _packed_batch(tok: Any, tasks: Iterable[Any], show: Demonstrator, rng: random.Random
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row of demonstrations, packed: (input ids [1, n], position ids [1, n], targets [n]: -100 on
    the segments not trained and where a sequence ends). `rng` draws the demonstrator's choices."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    for task in tasks:
        seq: list[int] = []
        for text, trained in show(task, rng):
            piece = list(tok.encode(text, add_special_tokens=False))
            seq += piece
            labels += piece if trained else [-100] * len(piece)
        ids += seq
        pos += range(len(seq))
    # labels are shifted by one: token t predicts t + 1; sequence boundaries never predict across
    target = torch.tensor([*labels[1:], -100])
    target[torch.tensor([*pos[1:], 0]) == 0] = -100
    return torch.tensor([ids]), torch.tensor([pos]), target


def accuracy(model_path: str | Path, env, n: int = 200, temperature: float = 0.0, seed: int = 0,
             max_tokens: int = 8) -> float:
    """Held-out accuracy of `model_path` on `env`'s eval split with the embedded engine (greedy when
    `temperature` is 0)."""
    tok = load_tokenizer(model_path)
    tasks = first_tasks(env, "eval", seed, n)
    engine = EmbeddedEngine(model_path, max_num_seqs=len(tasks), seed=seed)
    stop_ids, stop_strings = split_stops(tok, ["\n"])
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop_token_ids=stop_ids, stop=stop_strings,
                            seed=seed)
    requests = [GenerationRequest(request_id=str(i), prompt_ids=tok.encode(t.prompt), sampling=params)
                for i, t in enumerate(tasks)]
    rewards = [env.score(tasks[int(r.request_id)], tok.decode(r.completion_ids, skip_special_tokens=True)) >= 1.0
               for r in generate(engine, requests, timeout=600)]
    engine.close()
    return sum(rewards) / max(1, len(rewards))


def episode_accuracy(model_path: str | Path, env_name: str, env_options: dict, n: int = 200, temperature: float = 0.0,
                     seed: int = 0, max_tokens: int = 24, stop: tuple[str, ...] = ("\n",),
                     episode_tokens: int = 128, renderer: str = "plain") -> dict[str, float]:
    """Held-out accuracy of `model_path` on a multi-turn environment: one episode per eval task, played
    to its end in this process (embedded engine, the environment in-process: `LocalEpisodes`); a game's
    against its scripted player (accuracy = the win-rate).
    Returns {"accuracy", "tool_calls_per_episode", "tool_error_rate", "turns_per_episode", "failed"}."""
    tok = load_tokenizer(model_path)
    env = registry.build("env", env_name, env_options)
    tasks = first_tasks(env, "eval", seed, n)
    engine = EmbeddedEngine(model_path, max_num_seqs=len(tasks), seed=seed)
    pool = LocalEpisodes([Domain(env=PluginRef(name=env_name, options=env_options))])
    try:
        runs = run_episodes(engine, tok, pool, env_name, tasks,
                            SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=list(stop), seed=seed),
                            EpisodesConfig(max_tokens=episode_tokens), lambda: registry.build("renderer", renderer, {}, tok),
                            roles=tuple(getattr(env, "roles", ())))
    finally:
        engine.close()
    done = [r for r in runs if r is not None]
    calls = sum(r.info.get("tool_calls", 0.0) for r in done)
    return {"accuracy": sum(r.outcome is not None and r.outcome >= 1.0 for r in done) / max(1, len(runs)),
            "tool_calls_per_episode": calls / max(1, len(done)),
            "tool_error_rate": sum(r.info.get("tool_errors", 0.0) for r in done) / max(1.0, calls),
            "turns_per_episode": sum(r.turns for r in done) / max(1, len(done)),
            "failed": float(len(runs) - len(done))}
