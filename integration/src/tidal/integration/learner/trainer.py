"""One optimizer step of the learner, whatever the backend.

    trainer = Trainer(backend, TrainConfig(loss=PluginRef(name="ppo")))
    metrics = trainer.step(samples)          # this rank's share of the batch

Per step: advantages from the rewards (tidal-algos estimator by name, per group); sequences packed into
micro-batches of at most `micro_batch_tokens`; for each micro-batch the current logprobs are
recomputed (temperature as sampled), the staleness correction (tidal-staleness, by name) gives
importance weights and masks against the sampler's logprobs, and the tidal-algos loss (by name) is
backpropagated. Gradients accumulate over the micro-batches, each scaled so that the step's loss is
exactly the loss of the whole batch across all data-parallel ranks (token-mean or sequence-mean as the
loss aggregates). Then clipping, the optimizer and the LR schedule step once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tidal.core.config import ConfigStruct, PluginRef
from tidal.core.plugins import registry
from tidal.integration.learner.data import Sample, completion_logprobs, pad_rows


class TrainConfig(ConfigStruct):
    loss: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="ppo"))
    advantage: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="grpo"))
    correction: PluginRef | None = None  # staleness correction, e.g. {name = "tis", options = {cap = 2.0}}
    temperature: float = 1.0  # the sampler's temperature: logprobs are recomputed under it
    micro_batch_tokens: int = 4096  # packed tokens per forward; gradients accumulate over micro-batches


class Trainer:
    def __init__(self, backend: Any, cfg: TrainConfig) -> None:
        self.backend = backend
        self.cfg = cfg
        self.loss_fn = registry.create("policy_loss", cfg.loss.name, **cfg.loss.options)
        self.agg = cfg.loss.options.get("agg", _default_agg(self.loss_fn))
        self.estimator = registry.create("advantage_estimator", cfg.advantage.name, **cfg.advantage.options)
        self.correction = (registry.create("staleness_policy", cfg.correction.name, **cfg.correction.options)
                           if cfg.correction else None)

    def _global(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return t.tolist()

    def advantages(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        from tidal.algos.estimators import AdvantageInputs

        groups: dict[str, int] = {}
        index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples])
        width = max(len(s.completion) for s in samples)
        mask = pad_rows([torch.from_numpy(s.loss_mask) for s in samples], width, False).bool()
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        out = self.estimator(AdvantageInputs(rewards=rewards, mask=mask, group_index=index))
        return [out.advantages[i, : len(s.completion)] for i, s in enumerate(samples)]

    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        from tidal.algos.types import LossInputs
        from tidal.integration.learner.data import pack

        be = self.backend
        adv = self.advantages(samples) if samples else []
        tokens = float(sum(int(s.loss_mask.sum()) for s in samples))
        seqs = float(sum(1 for s in samples if s.loss_mask.any()))
        g_tokens, g_seqs = self._global([tokens, seqs])
        world = dist.get_world_size() if dist.is_initialized() else 1
        micros = pack(samples, self.cfg.micro_batch_tokens, be.device)
        # every rank must run the same number of forwards under FSDP (collectives in each)
        n_micro = int(max(self._global_max(len(micros)), 1))
        sums: dict[str, float] = defaultdict(float)
        for k in range(n_micro):
            if k >= len(micros):  # this rank has no more data: a zero-weight forward keeps collectives in step
                dummy = pack([samples[0]], self.cfg.micro_batch_tokens, be.device)[0] if samples else None
                if dummy is not None:
                    logits = be.forward(dummy.input_ids, dummy.position_ids)
                    be.backward(logits.sum() * 0.0, last=k == n_micro - 1)
                continue
            micro = micros[k]
            logits = be.forward(micro.input_ids, micro.position_ids)
            lps, ents = completion_logprobs(logits, micro, self.cfg.temperature, with_entropy=True)
            ss = [samples[i] for i in micro.index]
            width = max(len(s.completion) for s in ss)
            dev = logits.device
            inputs = dict(
                logprobs=pad_rows(lps, width),
                behaviour_logprobs=pad_rows([torch.from_numpy(s.logprobs).to(dev) for s in ss], width),
                advantages=pad_rows([adv[i].to(dev) for i in micro.index], width),
                mask=pad_rows([torch.from_numpy(s.loss_mask).to(dev) for s in ss], width, False).bool(),
                entropy=pad_rows([e.detach() for e in ents], width) if ents else None,
            )
            if self.correction is not None:
                from tidal.staleness.correction import CorrectionInputs

                corr = self.correction(CorrectionInputs(
                    learner_logprobs=inputs["logprobs"].detach(), behaviour_logprobs=inputs["behaviour_logprobs"],
                    mask=inputs["mask"], advantages=inputs["advantages"]))
                inputs["is_weights"] = corr.weights
                inputs["mask"] = inputs["mask"] & corr.mask
                for name, v in corr.metrics.items():
                    sums[f"staleness/{name}"] += float(v) / len(micros)
            out = self.loss_fn(LossInputs(**inputs))
            m_tokens = float(inputs["mask"].sum())
            m_seqs = float(inputs["mask"].any(-1).sum())
            share = (m_tokens / max(g_tokens, 1)) if self.agg == "token-mean" else (m_seqs / max(g_seqs, 1))
            # FSDP averages gradients over ranks: undo it so the step's gradient is the global sum's
            be.backward(out.loss * share * world, last=k == n_micro - 1)
            sums["loss/total"] += float(out.loss.detach()) * share * world
            for name, v in out.metrics.items():
                sums[name] += float(v) * share * world
            sums["train/entropy"] += float((inputs["entropy"] * inputs["mask"]).sum()) / max(g_tokens, 1) * world
        reduced = dict(zip(sums, self._global(list(sums.values())), strict=True)) if sums else {}
        metrics = {k: v / world for k, v in reduced.items()}
        metrics.update(be.clip_and_step())
        metrics["train/tokens"] = g_tokens
        metrics["train/sequences"] = g_seqs
        metrics["train/micro_batches"] = float(n_micro)
        return metrics

    def _global_max(self, n: int) -> float:
        t = torch.tensor([float(n)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


def _default_agg(loss_fn: Any) -> str:
    kw = getattr(loss_fn, "keywords", {}) or {}
    if "agg" in kw:
        return kw["agg"]
    import inspect

    fn = getattr(loss_fn, "func", loss_fn)
    param = inspect.signature(fn).parameters.get("agg")
    return param.default if param is not None else "token-mean"
