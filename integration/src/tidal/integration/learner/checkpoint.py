"""Learner checkpoints: model + optimizer + scheduler through torch.distributed.checkpoint (sharded
state is written by every rank, never gathered; one process writes it with torch.save into one file,
`state.pt`: ~5 ms against DCP's ~21 ms of Python that, from the background writer, slowed the next
training step by about as much), plus per-rank RNG state and the learner's progress
(policy version, steps, data cursor) in a small JSON file. `export_hf` writes a Hugging Face folder
(safetensors) that transformers and vLLM load.

    save_checkpoint(path, backend, {"version": 12, "step": 12, "cursor": "b-41"})
    progress = load_checkpoint(path, backend)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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
            import shutil

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


def export_hf(path: str | Path, backend: Any, source_model: str | Path) -> Path | None:
    """Write the current weights as a Hugging Face folder (config and tokenizer copied from
    `source_model`). Every rank must call it (weights are gathered); rank 0 writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {name: t.cpu() for name, t in backend.named_weights()}
    if _rank() != 0:
        return None
    path = Path(path)
    config = AutoConfig.from_pretrained(source_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        src = Path(source_model) / name
        if src.is_file():
            (path / name).write_bytes(src.read_bytes())
    return path
