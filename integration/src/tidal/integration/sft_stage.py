"""`tidal sft RECIPE`: the supervised first stage of a run (SFT, then RL), for any single-turn environment.

RL improves only what the policy sometimes gets right: a model that never earns a reward gives GRPO groups
of equal rewards and learns nothing (tidal.integration.signal_watch). This stage fits the recipe's model on
demonstrations, with the loss on the answer only, and writes a model folder that `tidal run RECIPE
model=OUT` takes. The demonstrations are either

- the reference answers of the recipe's first domain (its environment's train split: `Task.answer`), or
- a JSONL file (`--data`): one record a line, `{"prompt": ..., "completion": ...}`, or
  `{"messages": [{"role": ..., "content": ...}, ...]}` whose last message (the assistant's) is trained and
  the rest rendered by the tokenizer's chat template.

Each trained completion ends with the recipe's first stop string (`sampling.stop`, "\\n" by default), so
the model learns where an answer ends exactly as the run will stop it. Held-out accuracy (greedy, on the
environment's eval split, as the run's evaluation measures it) is printed before and after. The training
runs in this process (AdamW, the single backend's way); a recipe whose learner is sharded
(`learner.backend.name` other than "single") still gets a single-process SFT, and says so.
`tidal demo` warms its single-turn tasks up through `sft_stage` too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.integration.recipe import RunConfig
from tidal.integration.sft import Demonstrator, SFTConfig, accuracy, answer_demonstrator, sft
from tidal.rollout.tiny import load_tokenizer


@dataclass
class Record:
    """One demonstration from a JSONL file (what `sft`'s demonstrator is given as a task)."""

    prompt: str
    completion: str


class Records:
    """A JSONL file's demonstrations as an endless, shuffled train split (`tasks("train", seed)`)."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records

    def tasks(self, split: str, seed: int) -> Iterator[Record]:
        rng = random.Random(seed)
        while True:
            order = list(self.records)
            rng.shuffle(order)
            yield from order


def read_records(path: str | Path, tokenizer: Any) -> list[Record]:
    """The records of a JSONL file; ConfigError naming the line and what a record must hold."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"--data {path}: {e}", field="--data") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"--data {path}, line {n}: not JSON ({e})", field="--data") from None
        out.append(_record(rec, tokenizer, f"--data {path}, line {n}"))
    if not out:
        raise ConfigError(f"--data {path} holds no record: give one JSON object a line, "
                          '{"prompt": ..., "completion": ...} or {"messages": [...]}', field="--data")
    return out


def _record(rec: Any, tokenizer: Any, where: str) -> Record:
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        return Record(rec["prompt"], rec["completion"])
    messages = rec.get("messages") if isinstance(rec, dict) else None
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        last = messages[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            raise ConfigError(f"{where}: the last message must be the assistant's (the text trained), got "
                              f"{last.get('role')!r}", field="--data")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: chat records need a tokenizer with a chat template, and this model's has "
                              "none: give prompt/completion records instead", field="--data")
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        return Record(prompt, last["content"])
    raise ConfigError(f"{where}: a record is {{\"prompt\": str, \"completion\": str}} or {{\"messages\": [...]}}, "
                      f"got {str(rec)[:80]}", field="--data")


@dataclass
class StageResult:
    out: Path
    loss: float
    seconds: float
    accuracy_before: float | None  # held-out, greedy (None: the domain is multi-turn, measured by the run)
    accuracy_after: float | None


def sft_stage(cfg: RunConfig, out: str | Path, *, steps: int = 300, batch: int = 64, lr: float = 1e-3,
              data: str | Path | None = None, base: str | Path | None = None,
              demonstrate: Demonstrator | None = None,
              sft_options: dict[str, Any] | None = None, measure: bool = True,
              say: Callable[[str], None] = print) -> StageResult:
    """Fit `base` (default: the recipe's model) on the recipe's first domain's reference answers, or on
    `data`'s records, and write the result to `out`. `demonstrate` replaces the reference-answer
    demonstrator (the demo's tool and game warm starts)."""
    base = Path(base or cfg.model)
    domain = cfg.domains[0]
    env = registry.build("env", domain.env.name, domain.env.options, field="domains[0].env")
    single_turn = not callable(getattr(env, "episode", None))
    end = cfg.sampling.stop[0] if cfg.sampling.stop else ""
    if data is not None:
        source: Any = Records(read_records(data, load_tokenizer(base)))
        show: Demonstrator | None = demonstrate or (lambda r, rng: [(r.prompt, False), (r.completion + end, True)])
        what = f"{len(source.records)} records of {data}"
    else:
        if not single_turn and demonstrate is None:
            raise ConfigError(f"domains[0] ({domain.env.name}) is multi-turn: its tasks carry no single reference "
                              "answer to fit; give demonstrations with --data FILE.jsonl", field="domains[0].env")
        source = env
        show = demonstrate
        what = f"the reference answers of {domain.env.name} {dict(domain.env.options) or ''}".rstrip()
    if cfg.learner.backend.name != "single":
        say(f"      note: learner.backend.name = {cfg.learner.backend.name!r}; this warm start trains in one process")

    def held_out(model: Path) -> float | None:  # greedy, on the eval split, as the run's evaluation
        if not (measure and single_turn):
            return None
        return accuracy(model, env, n=cfg.eval.size, seed=cfg.seed, max_tokens=cfg.sampling.max_tokens)

    before = held_out(base)
    if before is not None:
        say(f"      held-out accuracy before: {100 * before:.1f}% (greedy)")
    scfg = SFTConfig(**{"steps": steps, "batch": batch, "lr": lr, "seed": cfg.seed, **(sft_options or {})})
    if show is None:
        show = answer_demonstrator(scfg, end)
    say(f"      SFT: {scfg.steps} steps of {scfg.batch} on {what}")
    stats = sft(base, out, source, scfg, progress=_progress(scfg.steps, say), demonstrate=show)
    after = held_out(Path(out))
    say(f"      SFT done in {stats['seconds']:.0f} s: loss {stats['loss']:.3f}"
        + (f", held-out accuracy {100 * after:.1f}% (greedy)" if after is not None else ""))
    return StageResult(Path(out), stats["loss"], stats["seconds"], before, after)


def _progress(total: int, say: Callable[[str], None]) -> Callable[[int, float], None]:
    every = max(1, total // 10)

    def show(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            say(f"      SFT step {step}/{total}  loss {loss:.3f}")

    return show
