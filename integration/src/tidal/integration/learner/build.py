"""Tidal's own learner rank: `build_learner` fills tidal-learner's `Learner` seams with the pieces of this
system. The train backend is found by name (`train_backend`: single, fsdp2, deepspeed; backends.py), the
step is `Trainer` (trainer.py: tidal-algos' losses, estimators and corrections, tidal-seqpar's packed
rows, tidal-moe-fsdp's routing replay), and batches come from tidal-buffer's `BatchClient`. The process
around it is process.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tidal.buffer.client import BatchClient
from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.core.protocol import Batch
from tidal.integration.learner.backends import has_sinks, pick_attention
from tidal.integration.learner.checks import check_lora
from tidal.integration.learner.data import Sample
from tidal.integration.learner.objective import Objective
from tidal.integration.learner.parallel import (
    check_parallel,
    ep_backend_options,
    model_config,
    setup_sequence_parallel,
)
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, LearnerConfig, ParallelConfig
from tidal.learner.learner import Learner

log = logging.getLogger("tidal.learner")


def build_learner(cfg: LearnerConfig) -> Learner:
    """A `Learner` rank with Tidal's own pieces: the train backend found by name (`train_backend`), the
    objective's plugins built once, sequence parallelism, a reference model when the loss reads one, and
    tidal-buffer's `BatchClient` for `learner.source = "buffer"`."""
    if not cfg.model:
        raise ValueError("the learner needs `model` (a local Hugging Face folder)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    objective = Objective.build(cfg.train)  # the loss, estimator and correction: built once, here
    backend, options, sp = _build_backend(cfg, objective, rank, world)
    reference = _load_reference(cfg, options.attn) if objective.reads_reference else None
    trainer = Trainer(backend, cfg.train, reference, routing_replay=cfg.moe.replay, sp=sp, objective=objective)

    def prepare(batch: Batch, full: bool) -> Any:
        """A batch as the trainer takes it; `full`: prepared ahead (packed, advantages without a critic)."""
        samples = [Sample.from_trajectory(t) for t in batch.trajectories]
        return trainer.prepare(samples) if full else samples

    def connect(dp_rank: int, dp: int, trained: list[str]) -> BatchClient:
        return BatchClient(cfg.buffer, dp_rank, dp, name=f"learner-{rank}", trained=trained,
                           curve=cfg.security.client("buffer"))

    return Learner(cfg, backend, trainer, prepare, sp=sp, connect=connect)


def _build_backend(cfg: LearnerConfig, objective: Objective, rank: int, world: int) -> tuple[Any, BackendConfig, Any]:
    """The train backend and sequence parallelism (collective), the parallel layout checked before the
    model is loaded: (the backend, the options it was built with (a value head added for a critic), the
    SP group or None)."""
    check_lora(cfg, world)  # refused before the model is loaded
    if cfg.parallel != ParallelConfig():
        check_parallel(cfg.parallel, world=world, config=model_config(cfg.model), backend=cfg.backend.name,
                       attn=cfg.backend.options.attn)
    torch.manual_seed(cfg.seed)
    options = cfg.backend.options
    if objective.needs_values and not options.value_head:
        log.info("advantage %r reads a critic's values (PPO): adding a value head", cfg.train.advantage.name)
        options = msgspec.structs.replace(options, value_head=True)
    # ep: the backend splits MoE experts over a (dp, ep) mesh (checked above by check_parallel)
    backend = registry.create("train_backend", cfg.backend.name, cfg.model, options, cfg.device,
                              **ep_backend_options(cfg.parallel, cfg.backend.name, world),
                              **({"lora": cfg.lora} if cfg.lora is not None else {}))
    sp = setup_sequence_parallel(cfg.parallel, backend)  # collective; None when sp = 1
    if sp is not None:
        m = sp.mesh
        log.info("rank %d: sequence-parallel rank %d of %d (%s: ulysses %d x ring %d), data-parallel share %d of %d",
                 rank, m.rank, m.size, cfg.parallel.sp_mode, m.ulysses, m.ring, sp.dp_rank, sp.dp)
    return backend, options, sp


def _load_reference(cfg: LearnerConfig, attn: str) -> Any:
    """The frozen reference model (a KL penalty, distillation): `reference_model`, else the starting one."""
    # heavy: transformers (seconds to import); only loading a model needs it
    from transformers import AutoModelForCausalLM

    ref_path = cfg.reference_model or cfg.model
    if cfg.reference_model and cfg.reference_model != cfg.model:
        check_same_vocabulary(cfg.model, cfg.reference_model)  # before its weights load
    reference: Any = AutoModelForCausalLM.from_pretrained(
        ref_path, attn_implementation=pick_attention(attn, torch.device(cfg.device), sinks=has_sinks(ref_path)))
    reference = reference.to(cfg.device)
    reference.requires_grad_(False)
    return reference


def check_same_vocabulary(model: str, reference: str) -> None:
    """Refuse a reference (teacher) whose vocabulary differs from the policy's: config.json's
    `vocab_size`, and the token -> id maps of their tokenizer.json files when both folders have one.
    Folders that are not local (a hub name) are left to load as they are."""
    student, teacher = Path(model), Path(reference)
    if not ((student / "config.json").is_file() and (teacher / "config.json").is_file()):
        return
    sizes = [json.loads((p / "config.json").read_text()).get("vocab_size") for p in (student, teacher)]
    vocabs = [_tokenizer_vocab(p) for p in (student, teacher)]
    differ = [f"vocab_size {sizes[1]} (reference) vs {sizes[0]} (model)"] if sizes[0] != sizes[1] else []
    if None not in vocabs and vocabs[0] != vocabs[1]:
        a, b = vocabs[1] or {}, vocabs[0] or {}
        changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        differ.append(f"tokenizer.json with {len(a)} (reference) vs {len(b)} (model) tokens, {len(changed)} of "
                      f"them missing from one or with another id (e.g. {changed[:3]})")
    if differ:
        raise ConfigError(
            f"learner.reference_model = {reference!r} (the reference / teacher) does not share the vocabulary of "
            f"learner.model = {model!r}: {'; '.join(differ)}. Distillation and the KL penalty compare the two "
            f"models' per-token logprobs of the same token ids, which mean the same text only under one "
            f"tokenizer. Choose a teacher of the student's model family (same tokenizer.json and vocab_size), "
            f"or leave learner.reference_model empty to use the starting model.",
            field="learner.reference_model")


def _tokenizer_vocab(folder: Path) -> dict[str, int] | None:
    """tokenizer.json's token -> id map (its model's vocabulary and its added tokens), or None without one."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs in id order
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    return {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
