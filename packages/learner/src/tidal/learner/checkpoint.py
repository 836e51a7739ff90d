"""Learner checkpoints: model + optimizer + scheduler through torch.distributed.checkpoint (sharded
state is written by every rank, never gathered; one process writes it with torch.save into one file,
`state.pt`: ~5 ms against DCP's ~21 ms of Python that, from the background writer, slowed the next
training step by about as much), plus per-rank RNG state and the learner's progress
(policy version, steps, data cursor) in a small JSON file. `export_hf` writes a Hugging Face folder
(safetensors) that transformers and vLLM load, from a live backend; `checkpoint_weights` + `write_hf`
do it from a checkpoint on disk (`tidal export`). `keep_last` keeps the newest N checkpoints. The
`Checkpointer` is the learner's seam: where and when it checkpoints, in the background or not, and which
trained batches a finished checkpoint lets it acknowledge.

    save_checkpoint(path, backend, {"version": 12, "step": 12, "cursor": "b-41"})
    progress = load_checkpoint(path, backend)
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tidal.core.episodes import snapshot_name
from tidal.learner.best import link

SINGLE_FILE = "state.pt"  # a one-process checkpoint's model + optimizer + scheduler


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def snapshot(backend: Any) -> dict[str, Any]:
    """A copy of the backend's checkpoint state, for `save_checkpoint(..., state=...)` on another thread
    while training goes on (one process, not sharded: the copy is a memcpy of model + optimizer)."""
    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(copy(v) for v in x)
        return x

    return {"state": copy(backend.state_dict()), "rng": torch.get_rng_state()}


def save_checkpoint(path: str | Path, backend: Any, progress: dict[str, Any],
                    state: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint to `path` (a folder; written to `path.tmp` and renamed when complete).
    `state`: a `snapshot(backend)` taken earlier (written instead of the backend's live state)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    if getattr(backend, "native_checkpoints", False):  # deepspeed, expert parallelism: their own format
        backend.save_native(str(tmp / "native"))
    elif _world() == 1:
        torch.save(backend.state_dict() if state is None else state["state"], tmp / SINGLE_FILE)
    else:
        dcp.save(backend.state_dict() if state is None else state["state"], checkpoint_id=str(tmp))
    rng = {"cpu": torch.get_rng_state() if state is None else state["rng"]}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng-{_rank()}.pt")
    if dist.is_initialized():
        dist.barrier()
    if _rank() == 0:
        (tmp / "progress.json").write_text(json.dumps(progress, indent=1))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(path: str | Path, backend: Any) -> dict[str, Any]:
    """Restore `backend` (model, optimizer, scheduler) and this rank's RNG; returns the progress dict."""
    path = Path(path)
    if not (path / "progress.json").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (progress.json missing; an interrupted save "
                                f"leaves {path.name}.tmp, which is never loaded)")
    if getattr(backend, "native_checkpoints", False):
        backend.load_native(str(path / "native"))
    elif (path / SINGLE_FILE).is_file():
        if _world() != 1:
            raise ValueError(f"the checkpoint at {path} was written by a one-process learner ({SINGLE_FILE}); "
                             f"resume it with one process, not {_world()}")
        backend.load_state_dict(torch.load(path / SINGLE_FILE, weights_only=True))
    else:
        state = backend.state_dict()
        dcp.load(state, checkpoint_id=str(path))
        backend.load_state_dict(state)
    rng_file = path / f"rng-{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "progress.json").read_text())


HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
            "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def export_hf(path: str | Path, backend: Any, source_model: str | Path) -> Path | None:
    """Write the current weights as a Hugging Face folder (config and tokenizer copied from
    `source_model`). Every rank must call it (`named_weights` gathers FSDP2 / DeepSpeed shards, a
    collective); rank 0 writes."""
    rank0 = _rank() == 0
    state = {}
    # the full policy: `export_weights` where the backend has it (LoRA: adapters merged), else what it sends
    weights = getattr(backend, "export_weights", backend.named_weights)
    for name, t in weights():  # every rank iterates to the end (the gathers are collective)
        if rank0:
            state[name] = t.cpu()
    if not rank0:
        return None
    return write_hf(path, state, source_model)


def snapshot_path(folder: str | Path, version: int) -> Path:
    """Where the self-play snapshot of `version` lives (the rollout workers read the same name)."""
    return Path(folder) / snapshot_name(version)


def write_snapshot(folder: str | Path, backend: Any, version: int) -> Path | None:
    """The current weights as one safetensors file, `snapshot_path(folder, version)` (self-play opponents).
    Every rank must call it (the gathers are collective); rank 0 writes, to a temporary name renamed when
    complete, so a reader never sees half a file."""
    # heavy: safetensors' torch half; only writing a snapshot needs it
    from safetensors.torch import save_file

    rank0 = _rank() == 0
    state = {}
    weights = getattr(backend, "export_weights", backend.named_weights)
    for name, t in weights():
        if rank0:
            state[name] = t.detach().to("cpu", copy=True).contiguous()
    if not rank0:
        return None
    path = snapshot_path(folder, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata={"version": str(version)})
    os.replace(tmp, path)
    return path


def write_hf(path: str | Path, state: dict[str, torch.Tensor], source_model: str | Path) -> Path:
    """`state` (a causal LM's full weights by name) as a Hugging Face folder at `path`: safetensors,
    config.json, and the tokenizer and generation config of `source_model`. Written to `path.tmp` and
    renamed when complete, so a folder at `path` is always whole."""
    # heavy: transformers (seconds to import); only writing a Hugging Face folder needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    config = AutoConfig.from_pretrained(source_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()  # a tied output head named once (DeepSpeed's named_parameters) takes the embedding
    unset = [n for n, t in model.state_dict().items() if t.is_meta]
    unknown = sorted(set(state) - set(model.state_dict()))
    if unset or unknown:
        raise ValueError(f"the weights do not fit {source_model}'s config: missing {unset[:5] or 'none'}, unknown "
                         f"{unknown[:5] or 'none'} ({len(unset)} and {len(unknown)} in all): was the checkpoint "
                         f"written by a run of another model?")
    model.save_pretrained(tmp, safe_serialization=True)
    for name in HF_FILES:
        src = Path(source_model) / name
        if src.is_file() and not (tmp / name).is_file():
            (tmp / name).write_bytes(src.read_bytes())
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def checkpoint_weights(path: str | Path, source_model: str | Path) -> dict[str, torch.Tensor]:
    """The policy's weights held by the checkpoint at `path`, read in this process without a learner:
    a one-process checkpoint (state.pt) or a sharded one (torch.distributed.checkpoint, fsdp2), read
    whole. Backends with a format of their own (deepspeed, expert parallelism) are refused: their
    learner exports at the end of a run (`export_dir`)."""
    path = Path(path)
    if not (path / "progress.json").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (progress.json missing)")
    if (path / "native").is_dir():
        raise ValueError(f"the checkpoint at {path} is in its backend's own format (deepspeed or expert "
                         f"parallelism; {path / 'native'}), which cannot be read without that learner: the "
                         f"learner writes the run's model folder itself when it stops (learner.export_dir)")
    if (path / SINGLE_FILE).is_file():
        model_state = torch.load(path / SINGLE_FILE, weights_only=True, map_location="cpu")["model"]
    else:
        # heavy: transformers (seconds to import); only writing a Hugging Face folder needs it
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source_model)
        model_state = dict(model.state_dict())
        dcp.load({"model": model_state}, checkpoint_id=str(path))
    return {k: v for k, v in model_state.items() if not k.startswith("value_head.")}


def keep_last(checkpoint_dir: str | Path, latest: str | Path, step: int, keep: int) -> None:
    """With `keep` > 1: the checkpoint just written at `latest` is also kept as `step-<step>` (hard
    links: no second copy on disk) and only the newest `keep` of those remain. Rank 0 only."""
    if keep <= 1 or _rank() != 0:
        return

    root, kept = Path(checkpoint_dir), Path(checkpoint_dir) / f"step-{step:06d}"
    if kept.exists():
        shutil.rmtree(kept)

    shutil.copytree(latest, kept, copy_function=link)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(old)


class Checkpointer:
    """The learner's checkpoints at <directory>/latest (the newest `keep` also as step folders), every
    `every` steps. A checkpoint written in the background (one process) is written from a snapshot while
    training goes on; the batches it records become acknowledgeable once it is on disk (`collect`)."""

    def __init__(self, directory: str | Path, backend: Any, *, every: int, keep: int,
                 background: ThreadPoolExecutor | None) -> None:
        self.latest: Path | None = Path(directory) / "latest" if directory else None
        self.backend, self.every, self.keep, self.background = backend, every, keep, background
        self._writing: Future | None = None
        self._covers: list[str] = []  # the batches the background checkpoint records

    def load(self) -> dict[str, Any] | None:
        """The progress of <directory>/latest, its state restored into the backend; None without one."""
        if self.latest is None or not (self.latest / "progress.json").is_file():
            return None
        return load_checkpoint(self.latest, self.backend)

    def due(self, step: int) -> bool:
        return self.latest is not None and self.every > 0 and step % self.every == 0

    def save(self, progress: dict[str, Any], covers: list[str], background: bool = False) -> list[str]:
        """Write a checkpoint recording `progress` (collective); returns the batches of `covers` that may be
        acknowledged now (all of them, or none while a background write is still going)."""
        assert self.latest is not None
        done = self.collect(wait=True)  # one writer of <dir>/latest at a time
        if not background or self.background is None:
            self._write(progress)
            return done + covers
        self._writing = self.background.submit(self._write, progress, snapshot(self.backend))
        self._covers = covers
        return done

    def collect(self, wait: bool) -> list[str]:
        """The batches a background checkpoint that finished records (raises what the write raised)."""
        fut = self._writing
        if fut is None or not (wait or fut.done()):
            return []
        self._writing = None
        fut.result()
        done, self._covers = self._covers, []
        return done

    def _write(self, progress: dict[str, Any], state: dict[str, Any] | None = None) -> None:
        assert self.latest is not None
        save_checkpoint(self.latest, self.backend, progress, state)
        keep_last(self.latest.parent, self.latest, progress["step"], self.keep)
