"""One optimizer step of the learner, whatever the backend.

    trainer = Trainer(backend, TrainConfig(loss=PluginRef(name="ppo")))
    metrics = trainer.step(samples)          # this rank's share of the batch

Per step: advantages from the rewards (tidal-algos estimator by name: advantages.py); sequences packed into
micro-batches of at most `micro_batch_tokens`; for each micro-batch the current logprobs are
recomputed (temperature as sampled), the staleness correction (tidal-staleness, by name) gives
importance weights and masks against the sampler's logprobs, and the tidal-algos loss (by name) is
backpropagated. Gradients accumulate over the micro-batches, each scaled so that the step's loss is
exactly the loss of the whole batch across all data-parallel ranks (token-mean or sequence-mean as the
loss aggregates). Then clipping, the optimizer and the LR schedule step once. Under sequence
parallelism (`sp=`, see tidal.integration.learner.parallel) each micro-batch's row is split over the
ranks of an SP group and its per-token values gathered, so the loss is the same as on one rank.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tidal.algos.types import LossInputs
from tidal.core.plugins import registry
from tidal.core.protocol import SamplingParams
from tidal.integration.learner.advantages import Advantages
from tidal.integration.learner.data import Micro, Sample, kv_lags, pack, token_logprobs
from tidal.integration.learner.objective import Objective
from tidal.integration.learner.parallel import SequenceParallel, Shard, average_grads
from tidal.learner.config import TrainConfig
from tidal.moe_fsdp.replay import replay_routing, router_routes, routing_mismatch, used_routes
from tidal.staleness.correction import CorrectionInputs

log = logging.getLogger("tidal.learner")


@dataclass(frozen=True, slots=True)
class StepTotals:
    """What one step's loss is normalised by, over all data-parallel shares (see `Trainer._totals`)."""

    tokens: float  # trained tokens
    seqs: float  # sequences with a trained token
    rows: float  # sequences
    norm_length: float | None  # seq-mean-token-sum-norm's length (None: another aggregation)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch made ready for `Trainer.step` (see `Trainer.prepare`): its samples, micro-batches and,
    without a critic, per-sample advantages and returns."""

    samples: list[Sample]
    micros: list[Any]
    advantages: list[torch.Tensor] | None
    returns: list[torch.Tensor] | None


class Trainer:
    """`reference`: a frozen model whose logprobs feed a KL penalty or distillation (required when the
    loss reads one, `Objective.reads_reference`). PPO mode (advantage "gae") needs a backend with
    `value_head=True`. `objective`: `cfg`'s plugins when the caller built them already."""

    def __init__(self, backend: Any, cfg: TrainConfig, reference: torch.nn.Module | None = None, *,
                 routing_replay: bool = False, sp: SequenceParallel | None = None,
                 objective: Objective | None = None) -> None:
        self.backend = backend
        self.cfg = cfg
        self.routing_replay = routing_replay
        # sequence parallelism (learner.parallel.sp > 1): each micro-batch split over this rank's SP group
        self.sp = sp
        objective = objective or Objective.build(cfg)
        if objective.reads_reference and reference is None:
            raise ValueError(f"loss {cfg.loss.name!r} with options {cfg.loss.options} needs a reference model")
        ref: Any = reference  # a transformers causal LM (its config and attention switch are transformers')
        self.reference = ref.eval() if ref is not None else None
        if ref is not None and ref.config._attn_implementation != backend.attention:
            # the same attention kernel as the policy: KL(policy || reference) is exactly 0 when equal
            ref.set_attn_implementation(backend.attention)
        self.estimator = objective.estimator
        self.adv = Advantages(self.estimator, cfg.advantage.name, sp)
        self.critic = objective.needs_values
        if self.critic and not getattr(backend.cfg, "value_head", False):
            raise ValueError(f"advantage {cfg.advantage.name!r} reads a critic's values: set "
                             f"learner.backend.options.value_head = true")
        # called just before the optimizer changes the parameters (the learner waits there for a
        # background weight send that still reads them)
        self.before_update: Callable[[], None] | None = None
        # a group's prompt once per row, its completions after it: only tidal_varlen reads that layout
        from tidal.seqpar.hf import VARLEN_ATTENTION

        self.share_prefix = cfg.share_prompts and backend.attention == VARLEN_ATTENTION
        if sp is not None and cfg.share_prompts:
            log.info("sequence parallelism: each sample is packed with its own prompt (train.share_prompts "
                     "needs tidal_varlen's shared-prefix layout, which a row split over ranks does not have)")
        self.loss_fn = objective.loss
        self.agg = cfg.loss.options.get("agg", _default_agg(self.loss_fn))
        # Dr.GRPO's constant length for the policy and value losses: the recipe's, else the step's (`_totals`)
        self.length_normalised = self.agg == "seq-mean-token-sum-norm" and _takes(self.loss_fn, "norm_length")
        self._value_loss = registry.create(
            "policy_loss", "value", clip=cfg.value_clip if cfg.value_clip > 0 else None, agg=self.agg)
        self._warned: set[str] = set()
        self.correction = objective.correction
        # the policy version this step trains from (the learner's, `at_version`): a token's KV lag is
        # measured against it, as the buffer measures a token's lag
        self.version = 0
        self.skipped_steps = 0  # steps whose loss or gradient was not finite: dropped (`step`)
        # lag_logprobs = "learner": version -> a frozen copy of the weights published as it (`published`)
        self.lagged: dict[int, torch.nn.Module] = {}
        if cfg.lag_logprobs == "learner":
            self._check_lagged(objective)
            self.published(0)  # the starting weights: what every generator holds before the first publish

    def _check_lagged(self, objective: Objective) -> None:
        """lag_logprobs = "learner" keeps whole copies of the policy in this process: one process, no
        sequence parallelism, and no correction that sets the anchor itself (decoupled PPO's proximal)."""
        if getattr(self.backend, "reduces_grads", False) or self.backend.world_size > 1 or self.sp is not None:
            raise ValueError("train.lag_logprobs = \"learner\" keeps a copy of the published weights in one "
                             "process: it needs the single backend without sequence parallelism (use \"sampler\")")
        if getattr(objective.correction, "needs_proximal", False):
            raise ValueError(f"train.lag_logprobs = \"learner\" anchors the ratio to the published weights, but "
                             f"correction {self.cfg.correction.name if self.cfg.correction else ''!r} anchors it to "
                             f"the proximal policy: choose one")
        if self.cfg.lag_snapshots < 1:
            raise ValueError(f"train.lag_snapshots must be >= 1, got {self.cfg.lag_snapshots}")

    def published(self, version: int) -> None:
        """The weights of `version` were published: keep a frozen copy (lag_logprobs = "learner"; the
        newest `lag_snapshots`) to recompute the logprobs of the tokens it samples."""
        if self.cfg.lag_logprobs != "learner":
            return
        self.lagged[version] = copy.deepcopy(self.backend._module()).eval().requires_grad_(False)
        for old in sorted(self.lagged)[: -self.cfg.lag_snapshots]:
            del self.lagged[old]

    def at_version(self, version: int) -> None:
        """The learner holds policy `version` (called before each step)."""
        self.version = version

    @property
    def fallback(self) -> SamplingParams:
        return SamplingParams(temperature=self.cfg.temperature)

    def _check_sampling(self, samples: Sequence[Sample]) -> None:
        """Say loudly, once per kind, when a trajectory's sampling cannot be reproduced exactly."""
        unknown = [s.id for s in samples if s.sampling is None]
        if unknown and "unknown" not in self._warned:
            self._warned.add("unknown")
            log.warning("trajectory %s (and %d more this step) carries no sampling parameters (a producer older "
                        "than protocol 1.2?): its logprobs are recomputed at train.temperature = %g with no top-k "
                        "or top-p; if it was sampled otherwise, every IS weight on it is biased", unknown[0],
                        len(unknown) - 1, self.cfg.temperature)
        greedy = [s.id for s in samples if s.sampling is not None and s.sampling.temperature <= 0]
        if greedy:
            raise ValueError(f"trajectory {greedy[0]} was sampled greedily (temperature 0): its sampler's "
                             f"distribution is a point mass, there is no policy gradient to take; sample training "
                             f"data at a temperature > 0")

    def _recorded_routes(self, micro: Any, samples: Sequence[Sample]) -> torch.Tensor | None:
        """The experts each completion token's sampler used, at the row position that produced it
        ([row_len, moe layers, k], -1 where nothing was recorded: prompts, samples without routing)."""
        layers = getattr(self.backend, "moe_layers", 0)
        recorded = [samples[i].routing for i in micro.index]
        if not layers or micro.pred is None or all(r is None for r in recorded):
            return None
        k = next(r.shape[2] for r in recorded if r is not None)
        bad = next((r.shape for r in recorded if r is not None and r.shape[1:] != (layers, k)), None)
        if bad is not None:
            raise ValueError(f"a trajectory's routing has shape {bad} but the learner's model has {layers} MoE "
                             f"layers of top-{k}: sampler and learner run different models")
        flat = [torch.full((len(samples[i].completion), layers, k), -1, dtype=torch.long) if r is None
                else torch.from_numpy(np.asarray(r, np.int64)) for i, r in zip(micro.index, recorded, strict=True)]
        routes = torch.full((micro.tokens, layers, k), -1, dtype=torch.long)
        routes[micro.pred.cpu()] = torch.cat(flat)
        return routes.to(self.backend.device)

    def _routing_metrics(self, routes: torch.Tensor, micro: Any, sums: dict[str, float], n_micro: int) -> None:
        """How often the learner's own router disagrees with the sampler's routing (the expert set of a
        token, per layer), and how often the experts actually used did (0 under replay)."""
        module = self.backend._module()
        rec = routes[micro.pred]
        sums["moe/router_mismatch"] += float(routing_mismatch(rec, router_routes(module)[micro.pred]).mean()) / n_micro
        sums["moe/used_mismatch"] += float(routing_mismatch(rec, used_routes(module)[micro.pred]).mean()) / n_micro

    def _global(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return t.tolist()

    def advantages(self, samples: Sequence[Sample], values: list[torch.Tensor] | None = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample advantages (and value targets in PPO mode, from the critic's `values`)."""
        return self.adv(samples, values)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the trainer beside the weights, JSON-able: the advantage estimator's
        state (RAE's baselines) as of the last batch trained; {} when it has none."""
        return self.adv.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adv.load_state_dict(state)

    def _shard(self, micro: Any) -> tuple[Any, Shard | None]:
        """(what this rank's forward takes: the micro-batch, or under sequence parallelism its shard of
        it; the shard, or None)"""
        if self.sp is None:
            return micro, None
        shard = self.sp.shard(micro)
        return shard.micro, shard

    def _forward(self, local: Any, critic: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [1, n, V], critic values [n] or None) at the positions `local.pred` that predict the
        completion tokens (logits elsewhere are not computed, except in PPO mode)."""
        be = self.backend
        if not critic:  # the lm_head skips the prompts
            return be.forward(local.input_ids, local.position_ids, local.layout, keep=local.pred), None
        logits, values = be.forward_with_values(local.input_ids, local.position_ids, local.layout)
        return logits[:, local.pred], values[0, local.pred]

    def _old_values(self, samples: Sequence[Sample], micros: list, n_micro: int) -> list[torch.Tensor]:
        """PPO: the critic's values before this step (no grad), for GAE and value clipping."""
        out: dict[int, torch.Tensor] = {}  # sample index -> its values
        with torch.no_grad():
            for k in range(n_micro):
                micro = micros[k] if k < len(micros) else self._dummy(samples)
                local, shard = self._shard(micro)
                _, values = self._forward(local, critic=True)
                assert values is not None  # critic=True
                if shard is not None:
                    (values,) = shard.gather(values)
                if k < len(micros):  # critic value of each completion token, at the position predicting it
                    for i, v in zip(micro.index, values.split([t for _, _, t in micro.spans]), strict=True):
                        out[i] = v.detach().float()
        return [out[i] for i in range(len(samples))]  # every sample is in one micro-batch

    def _dummy(self, samples: Sequence[Sample]) -> Any:
        """A forward for a rank that has run out of data this step (sharded backends run collectives in
        every forward, so all ranks must make the same number): its first sequence, or two pad tokens
        when its share is empty; it always enters the loss with weight zero."""
        if samples:
            return pack([samples[0]], self.cfg.micro_batch_tokens, self.backend.device)[0]
        row = torch.zeros((1, 2), dtype=torch.long, device=self.backend.device)
        return Micro(row, torch.arange(2, device=self.backend.device)[None], [], [])

    def prepare(self, samples: Sequence[Sample]) -> Prepared:
        """What a step does before its first forward and without the parameters: (an estimator without a
        critic or state) the advantages, then leave out greedy baseline members, check the sampling and pack
        the micro-batches. No collectives: the learner runs it for the next batch while this step trains.
        A stateful estimator's advantages wait for `step`: taken here, a batch prepared ahead would move its
        state before the batch training now."""
        ahead = samples and not self.critic and not self.adv.stateful
        adv, returns = self.advantages(samples) if ahead else (None, None)
        if any(s.baseline for s in samples):  # greedy baseline members: their rewards were read, never trained
            keep = [i for i, s in enumerate(samples) if not s.baseline]
            samples = [samples[i] for i in keep]
            adv = None if adv is None else [adv[i] for i in keep]
            returns = None if returns is None else [returns[i] for i in keep]
        self._check_sampling(samples)
        micros = pack(samples, self.cfg.micro_batch_tokens, self.backend.device, share_prefix=self.share_prefix,
                      fallback=self.fallback)
        return Prepared(list(samples), micros, adv, returns)

    def step(self, samples: Sequence[Sample] | Prepared) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (`samples`, or `prepare(samples)`)."""
        prepared = samples if isinstance(samples, Prepared) else self.prepare(samples)
        samples, micros = prepared.samples, prepared.micros
        be = self.backend
        totals = self._totals(samples)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # every rank must run the same number of forwards under FSDP (collectives in each)
        n_micro = int(max(self._global_max(len(micros)), 1))
        old_values = self._old_values(samples, micros, n_micro) if self.critic else None
        if prepared.advantages is not None:
            adv, returns = prepared.advantages, prepared.returns
        else:  # PPO mode (GAE reads the critic's values from just now), or a stateful estimator, in batch order
            adv, returns = self.advantages(samples, old_values) if samples or self.adv.synced else ([], None)
        sums: dict[str, float] = defaultdict(float)
        for k in range(n_micro):
            if k >= len(micros):  # this rank has no more data: a zero-weight forward keeps collectives in step
                local, _ = self._shard(self._dummy(samples))
                if self.critic:
                    logits, values = be.forward_with_values(local.input_ids, local.position_ids, local.layout)
                    zero = logits.sum() * 0.0 + values.sum() * 0.0
                else:
                    zero = be.forward(local.input_ids, local.position_ids, local.layout).sum() * 0.0
                be.backward(zero, last=k == n_micro - 1)
                continue
            micro = micros[k]
            local, shard = self._shard(micro)
            routes = self._recorded_routes(micro, samples)  # [row, layers, k] as sampled, or None
            if routes is not None and shard is not None:
                routes = shard.rows(routes, pad_value=-1)  # this rank's tokens' routes
            with ExitStack() as replaying:
                if routes is not None and self.routing_replay:  # every token to its sampler's experts
                    replaying.enter_context(replay_routing(be._module(), routes))
                self._forward_backward(micro, shard, routes, samples, adv, returns, old_values, sums,
                                       totals=totals, world=world, n_micros=len(micros),
                                       last=k == n_micro - 1)
        # under sequence parallelism every rank of an SP group adds the same (whole micro-batch) metrics:
        # _forward_backward scales them by the number of SP groups (dp), not of ranks
        metrics = {k: v / world for k, v in self._global_dict(sums).items()}
        if self.sp is not None:
            self.sp.reduce_grads(be)
        else:  # data-parallel replicas of a backend that does not reduce (single): one gradient, one step
            average_grads(be, world)
        if self.before_update is not None:
            self.before_update()
        # a step whose loss (summed over every rank, so all agree) or gradient norm is not finite changes
        # nothing: skipped and counted, the run goes on (the learner logs the batch)
        loss_finite = all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/"))
        metrics.update(be.clip_and_step(skip=not loss_finite))
        self.skipped_steps += int(metrics.get("train/skipped_nonfinite", 0.0))
        metrics["train/skipped_steps_total"] = float(self.skipped_steps)
        metrics["train/tokens"] = totals.tokens
        metrics["train/sequences"] = totals.seqs
        metrics["train/micro_batches"] = float(n_micro)
        metrics["signal/nonzero_adv_frac"] = self._signal_share(adv)
        return metrics

    def _signal_share(self, adv: list) -> float:
        """The share of the step's samples (all ranks) whose advantage is nonzero somewhere: the ones that
        can move the policy (tidal.integration.signal_watch says what a run without any means)."""
        moving = sum(1 for a in adv if bool((torch.as_tensor(a).abs() > 1e-8).any()))
        moving_all, total = self._global([float(moving), float(len(adv))])
        return moving_all / total if total else 0.0

    def _forward_backward(self, micro: Any, shard: Shard | None, routes: torch.Tensor | None,
                          samples: Sequence[Sample], adv: list, returns: list | None, old_values: list | None,
                          sums: dict[str, float], *, totals: StepTotals, world: int, n_micros: int,
                          last: bool) -> None:
        """One micro-batch: forward, logprobs as sampled, corrections, loss, backward (its gradient scaled
        to its share of the whole step's batch); its metrics are added to `sums`. With a `shard` (sequence
        parallelism) the forward runs on this rank's tokens, and the per-token logprobs, entropies and
        values are gathered from the SP group, so the loss below is the whole micro-batch's on every rank."""
        local = micro if shard is None else shard.micro
        lp, ent, values, dev = self._policy_logprobs(local, shard, routes, sums, n_micros)
        # metrics are sums over the ranks of each data-parallel share (an SP group adds the same ones sp times)
        dp = world // (shard.mesh.size if shard is not None else 1)
        inputs, lp = self._loss_inputs(micro, [samples[i] for i in micro.index], lp, ent, adv, dev, sums,
                                       g_tokens=totals.tokens, dp=dp)
        if self.reference is not None:
            self._add_reference(inputs, micro, local, shard, lp)
        if self.lagged:
            self._add_lagged(inputs, micro, local, [samples[i] for i in micro.index], sums, totals.tokens)
        if self.correction is not None:
            self._add_correction(inputs, micro, [samples[i] for i in micro.index], sums, n_micros)
        loss, out = self._loss(inputs, micro, values, returns, old_values, dev, totals)
        self._backward(loss, out.metrics, inputs, sums, totals=totals, dp=dp, world=world, last=last)

    def _policy_logprobs(self, local: Any, shard: Shard | None, routes: torch.Tensor | None,
                         sums: dict[str, float], n_micros: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.device]:
        """The current policy's forward: (logprobs [n], entropies [n], critic values [n] or None, device)
        of the micro-batch's completion tokens, gathered from the SP group under sequence parallelism."""
        logits, values = self._forward(local, self.critic)
        lp, ent = token_logprobs(logits, local, with_entropy=True)
        assert ent is not None  # with_entropy=True
        if routes is not None:
            self._routing_metrics(routes, local, sums, n_micros)
        if shard is not None:
            if values is None:
                lp, ent = shard.gather(lp, ent)
            else:
                lp, ent, values = shard.gather(lp, ent, values)
        return lp, ent, values, logits.device

    def _loss_inputs(self, micro: Any, ss: list[Sample], lp: torch.Tensor, ent: torch.Tensor, adv: list,
                     dev: torch.device, sums: dict[str, float], *, g_tokens: float, dp: int
                     ) -> tuple[dict[str, Any], torch.Tensor]:
        """The loss's inputs, padded [rows, width], for the micro-batch's samples `ss`; and the logprobs
        with the tokens outside the policy's support replaced by the sampler's (they leave the loss)."""

        def flat(arrays: list[np.ndarray], dev: torch.device = dev) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(arrays)).to(dev)

        behaviour = flat([s.logprobs for s in ss])
        trained = flat([s.loss_mask for s in ss]).bool()
        # a token outside the current policy's top-k/top-p support has probability 0 under it: no
        # ratio, no gradient. It leaves the loss, counted (record sampling masks to keep them all)
        outside = ~torch.isfinite(lp.detach())
        if bool(outside.any()):
            lp = torch.where(outside, behaviour, lp)
            trained = trained & ~outside
            sums["staleness/outside_support"] += float(outside.sum()) / max(g_tokens, 1) * dp
        inputs = dict(
            logprobs=micro.padded(lp),
            behaviour_logprobs=micro.padded(behaviour),
            advantages=micro.padded(torch.cat([adv[i] for i in micro.index]).to(dev)),
            mask=micro.padded(trained, False).bool(),
            # with its gradient: a loss's entropy bonus (entropy_coef) acts through it
            entropy=micro.padded(ent),
        )
        return inputs, lp

    def _add_reference(self, inputs: dict[str, Any], micro: Any, local: Any, shard: Shard | None,
                       lp: torch.Tensor) -> None:
        """The frozen reference's logprobs (`ref_logprobs`), its unsupported tokens masked out."""
        with torch.no_grad():
            assert self.reference is not None
            ref_logits = self.reference(input_ids=local.input_ids, position_ids=local.position_ids,
                                        use_cache=False, logits_to_keep=local.pred,
                                        **self.backend.layout_kw(local.layout)).logits
            ref_lp, _ = token_logprobs(ref_logits, local)
            if shard is not None:
                (ref_lp,) = shard.gather(ref_lp)
            # outside the reference's processed support: no KL term can be computed there
            ref_outside = ~torch.isfinite(ref_lp)
            ref_lp = torch.where(ref_outside, lp.detach(), ref_lp)
        inputs["ref_logprobs"] = micro.padded(ref_lp)
        inputs["mask"] = inputs["mask"] & ~micro.padded(ref_outside, False).bool()

    def _add_lagged(self, inputs: dict[str, Any], micro: Any, local: Any, ss: list[Sample],
                    sums: dict[str, float], g_tokens: float) -> None:
        """`old_logprobs`, the anchor: each token's logprob under the weights published as the version that
        sampled it, recomputed here; the sampler's where that version is no longer (or not) kept, or where
        the token is outside the lagged policy's processed support."""
        dev = inputs["logprobs"].device
        versions = torch.from_numpy(np.concatenate([s.versions for s in ss])).to(dev)
        anchor = torch.from_numpy(np.concatenate([s.logprobs for s in ss])).to(dev)
        recomputed = torch.zeros_like(versions, dtype=torch.bool)
        with torch.no_grad():
            for v in sorted(set(versions.tolist()) & set(self.lagged)):
                logits = self.lagged[v](input_ids=local.input_ids, position_ids=local.position_ids, use_cache=False,
                                        logits_to_keep=local.pred, **self.backend.layout_kw(local.layout)).logits
                lagged, _ = token_logprobs(logits, local)
                take = (versions == v) & torch.isfinite(lagged)
                anchor = torch.where(take, lagged, anchor)
                recomputed |= take
        trained = torch.from_numpy(np.concatenate([s.loss_mask for s in ss])).to(dev).bool()
        sums["staleness/lag_logprobs_from_sampler"] += float((trained & ~recomputed).sum()) / max(g_tokens, 1)
        inputs["old_logprobs"] = micro.padded(anchor)

    def _add_correction(self, inputs: dict[str, Any], micro: Any, ss: list[Sample], sums: dict[str, float],
                        n_micros: int) -> None:
        """The staleness correction's importance weights and mask (and the proximal logprobs it asks for)."""
        assert self.correction is not None
        proximal = None
        if getattr(self.correction, "needs_proximal", False):
            # one optimizer step per batch: the proximal policy is these parameters before the
            # step, i.e. exactly the logprobs just computed; the loss's ratio is taken against it
            proximal = inputs["logprobs"].detach()
            inputs["old_logprobs"] = proximal
        corr = self.correction(CorrectionInputs(
            learner_logprobs=inputs["logprobs"].detach(), behaviour_logprobs=inputs["behaviour_logprobs"],
            mask=inputs["mask"], advantages=inputs["advantages"], proximal_logprobs=proximal,
            kv_lag=kv_lags(micro, ss, self.version, inputs["mask"].device)))
        inputs["is_weights"] = corr.weights
        inputs["mask"] = inputs["mask"] & corr.mask
        for name, v in corr.metrics.items():
            sums[f"staleness/{name}"] += float(v) / n_micros

    def _loss(self, inputs: dict[str, Any], micro: Any, values: torch.Tensor | None, returns: list | None,
              old_values: list | None, dev: torch.device, totals: StepTotals) -> tuple[torch.Tensor, Any]:
        """The policy loss (plus the critic's value loss in PPO mode) and its outputs."""
        # the step's length constant (see `_totals`), not each micro-batch's own padded width
        extra = {"norm_length": totals.norm_length} if totals.norm_length is not None else {}
        out = self.loss_fn(LossInputs(**inputs), **extra)
        loss = out.loss
        if self.critic:
            assert values is not None and returns is not None and old_values is not None
            vin = LossInputs(
                logprobs=inputs["logprobs"], behaviour_logprobs=inputs["behaviour_logprobs"],
                advantages=inputs["advantages"], mask=inputs["mask"],
                values=micro.padded(values),
                old_values=micro.padded(torch.cat([old_values[i] for i in micro.index]).to(dev)),
                returns=micro.padded(torch.cat([returns[i] for i in micro.index]).to(dev)))
            vout = self._value_loss(vin, **extra)
            loss = loss + self.cfg.value_coef * vout.loss
            out.metrics["loss/value"] = vout.loss.detach()
        return loss, out

    def _backward(self, loss: torch.Tensor, loss_metrics: dict[str, Any], inputs: dict[str, Any],
                  sums: dict[str, float], *, totals: StepTotals, dp: int, world: int, last: bool) -> None:
        """Backward of `loss` scaled to the micro-batch's share of the step; its metrics added to `sums`."""
        g_tokens = totals.tokens
        # sampler-vs-learner mismatch (k3 estimate of KL(sampler || learner) over trained tokens)
        log_ratio = (inputs["logprobs"].detach() - inputs["behaviour_logprobs"]).clamp(-20, 20)
        k3 = (log_ratio.exp() - 1 - log_ratio) * inputs["mask"]
        sums["staleness/mismatch_kl"] += float(k3.sum()) / max(g_tokens, 1) * dp
        if "ref_logprobs" in inputs:
            kl = ((inputs["logprobs"].detach() - inputs["ref_logprobs"]) * inputs["mask"]).sum()
            sums["kl/reference"] += float(kl) / max(g_tokens, 1) * dp
        share = self._share(inputs["mask"], totals)
        # FSDP averages gradients over ranks: undo it so the step's gradient is the global sum's (under
        # sequence parallelism the SP ranks' gradients sum to their micro-batch's, then the same holds)
        self.backend.backward(loss * share * world, last=last)
        sums["loss/total"] += float(loss.detach()) * share * dp
        # a token-sum loss adds up over micro-batches (share 1), and so do the terms it aggregates (loss/*,
        # kl/ref, entropy); its other metrics (ratio/mean, clip fractions) are token averages: weighed by
        # the micro-batch's tokens, as under token-mean
        per_token = float(inputs["mask"].sum()) / max(g_tokens, 1) if self.agg == "token-sum" else share
        for name, v in loss_metrics.items():
            summed = name.startswith(("loss/", "kl/ref", "entropy"))
            sums[name] += float(v) * (share if summed else per_token) * dp
        sums["train/entropy"] += float((inputs["entropy"].detach() * inputs["mask"]).sum()) / max(g_tokens, 1) * dp

    def _totals(self, samples: Sequence[Sample]) -> StepTotals:
        """The whole step's trained tokens, sequences and rows over every data-parallel share, and the
        length constant of `seq-mean-token-sum-norm` when the recipe leaves it to the learner: the step's
        longest completion, so that the loss does not depend on how the batch was packed."""
        tokens = float(sum(int(s.loss_mask.sum()) for s in samples))
        seqs = float(sum(1 for s in samples if s.loss_mask.any()))
        sp = self.sp.size if self.sp is not None else 1  # the ranks of an SP group hold the same samples
        g_tokens, g_seqs, g_rows = (x / sp for x in self._global([tokens, seqs, float(len(samples))]))
        norm_length = self.cfg.loss.options.get("norm_length") if self.length_normalised else None
        if self.length_normalised and norm_length is None:
            norm_length = max(self._global_max(max((len(s.completion) for s in samples), default=0)), 1.0)
        return StepTotals(g_tokens, g_seqs, g_rows, norm_length)

    def _share(self, mask: torch.Tensor, totals: StepTotals) -> float:
        """A micro-batch's share of the step, as its loss aggregates: its trained tokens (token-mean), its
        rows (seq-mean-token-sum-norm: a sum over B x L), 1 (token-sum: each micro-batch's loss is its own
        sum, and the step's is the sum of theirs), else its sequences with a trained token."""
        if self.agg == "token-sum":
            return 1.0
        if self.agg == "token-mean":
            return float(mask.sum()) / max(totals.tokens, 1)
        if self.agg == "seq-mean-token-sum-norm":
            return mask.shape[0] / max(totals.rows, 1)
        return float(mask.any(-1).sum()) / max(totals.seqs, 1)

    def _global_dict(self, values: dict[str, float]) -> dict[str, float]:
        """Sum metric dicts over ranks; a rank with no data this step contributes no keys (so the key
        sets differ, and a plain all_reduce of a vector would not line up)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return dict(values)
        gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, dict(values))
        out: dict[str, float] = defaultdict(float)
        for d in gathered:
            for k, v in d.items():
                out[k] += v
        return dict(out)

    def _global_max(self, n: int) -> float:
        t = torch.tensor([float(n)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


def _default_agg(loss_fn: Any) -> str:
    kw = getattr(loss_fn, "keywords", {}) or {}
    if "agg" in kw:
        return kw["agg"]

    fn = getattr(loss_fn, "func", loss_fn)
    # a loss without an `agg` option says how it reduces (OAPL: a mean over sequences)
    stated = getattr(loss_fn, "aggregation", None) or getattr(fn, "aggregation", None)
    if stated is not None:
        return stated
    param = inspect.signature(fn).parameters.get("agg")
    return param.default if param is not None else "token-mean"


def _takes(loss_fn: Any, option: str) -> bool:
    """Whether the loss (a partial of a function, or any callable) takes `option` as a keyword."""
    try:
        return option in inspect.signature(getattr(loss_fn, "func", loss_fn)).parameters
    except (TypeError, ValueError):
        return False
