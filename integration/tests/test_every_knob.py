"""Every knob acts: each numeric or boolean option of every registered policy loss, advantage estimator
and staleness correction changes what it claims to (the gradient; the advantages; the importance
weights and mask) on a small fixed batch, unless the plugin declares it metric-only or names where it
acts (`tidal.core.plugin_options.declare(acts_with=..., metric_only=...)`; the recipe refuses it
elsewhere). The plugins are read from the registry, so a newly registered one is covered as it is.

Then the same through the learner's Trainer, for the options it interprets between the recipe and the
loss (kl_coef with a reference model, entropy_coef, the aggregation and its length normalisation), and
the step's gradient is the same however the batch is packed into micro-batches.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from tidal.algos.aggregation import AGG_MODES
from tidal.algos.estimators import AdvantageInputs
from tidal.algos.kl import KL_ESTIMATORS
from tidal.algos.types import LossInputs
from tidal.core.config import PluginRef
from tidal.core.errors import ConfigError
from tidal.core.plugin_options import NONZERO, declared, options_type
from tidal.core.plugins import registry
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig
from tidal.staleness.correction import CorrectionInputs

pytestmark = pytest.mark.timeout(300)

KINDS = ("policy_loss", "advantage_estimator", "correction")
B, T = 6, 7
LENGTHS = [7, 5, 3, 7, 2, 6]


def knobs(kind: str, name: str) -> list[tuple[str, Any, bool]]:
    """(option, default, is_int) for each int, float or bool option the plugin declares, without the
    metric-only ones."""
    factory = registry.get(kind, name)
    typ = options_type(kind, name, factory)
    if typ is None:  # unchecked options (only **options, nothing declared): none to enumerate
        return []
    out = []
    for f in msgspec.structs.fields(typ):
        base = {a for a in typing.get_args(f.type) if a is not type(None)} or {f.type}
        if f.name in declared(factory).metric_only or not base <= {int, float, bool}:
            continue
        out.append((f.name, f.default, base == {int}))
    return out


def changed(default: Any, is_int: bool) -> list[Any]:
    """Other values to try, the first that builds and changes the result is enough (a clip can only
    act once its range is crossed, and some values are refused: a lower bound above the upper one)."""
    if isinstance(default, bool):
        return [not default]
    if default is None or default is msgspec.NODEFAULT:
        values = [0.5, 2.0, 3.0, 0.1, 10.0, 1.0]
    else:
        values = [default * 4, default / 4, default + 1.0, 0.5, 2.0, 0.0] if default else [0.5, 2.0, 0.1, 1.0]
    return [int(v) for v in values if int(v) != default] if is_int else [v for v in values if v != default]


def default_of(kind: str, name: str, option: str) -> Any:
    typ = options_type(kind, name, registry.get(kind, name))
    return next(f.default for f in msgspec.structs.fields(typ) if f.name == option)


def context(kind: str, name: str, option: str) -> dict[str, Any]:
    """The other options `option` needs to act (its `acts_with`), NONZERO as 0.5."""
    needs = declared(registry.get(kind, name)).acts_with.get(option, {})
    return {k: (0.5 if v == NONZERO else v) for k, v in needs.items()}


# ---------------------------------------------------------------- the probes: one fixed batch per kind

def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp = -torch.rand(B, T, generator=g) * 3 - 0.2
    # token ratios over about [e^-3, e^3], each row's mean log-ratio set on either side of 0 for either
    # sign of advantage (sequence-level clips), a reference up to 3.5 away: every clip and cap is crossed
    spread = (torch.rand(B, T, generator=g) * 2 - 1) * mask
    spread = (spread - spread.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)) * mask
    row = torch.tensor([0.4, 0.3, -0.3, -0.4, 0.2, 0.25])[:, None]
    return dict(mask=mask, logprobs=logp, behaviour=logp + 2.5 * spread + row,
                ref=logp + 3.5 * (torch.rand(B, T, generator=g) * 2 - 1),
                advantages=torch.tensor([1.0, -1.0, 0.5, -0.7, 1.3, -0.2])[:, None].expand(B, T) * mask,
                entropy=torch.rand(B, T, generator=g) * 2, values=torch.randn(B, T, generator=g),
                old_values_shift=(torch.rand(B, T, generator=g) * 2 - 1) * 0.6,
                returns=torch.randn(B, T, generator=g))


def loss_probe(loss: Callable[[LossInputs], Any]) -> torch.Tensor:
    """The gradient of the loss w.r.t. everything that carries one: logprobs, entropy, critic values."""
    b = _batch()
    leaves = [b["logprobs"].clone().requires_grad_(), b["entropy"].clone().requires_grad_(),
              b["values"].clone().requires_grad_()]
    out = loss(LossInputs(logprobs=leaves[0], behaviour_logprobs=b["behaviour"], advantages=b["advantages"],
                          mask=b["mask"], ref_logprobs=b["ref"], entropy=leaves[1], values=leaves[2],
                          old_values=b["values"] + b["old_values_shift"], returns=b["returns"]))
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    return torch.cat([(gr if gr is not None else torch.zeros_like(x)).flatten() for gr, x in zip(grads, leaves,
                                                                                                 strict=True)])


def estimator_probe(estimator: Callable[[AdvantageInputs], Any]) -> torch.Tensor:
    """Advantages (and value targets) of two groups of three, with critic values, two steps and a role each.
    A stateful estimator (RAE's running baselines) sees two other batches first, so that its update acts."""
    b = _batch()

    def run(rewards: list[float]) -> Any:
        return estimator(AdvantageInputs(
            rewards=torch.tensor(rewards), mask=b["mask"],
            group_index=torch.tensor([0, 0, 0, 1, 1, 1]), values=b["values"],
            step_rewards=torch.tensor([[0.5, 1.0], [0.0, 0.2], [1.0, -1.0], [0.3, 0.0], [0.0, 1.0], [0.7, 0.1]]),
            step_ends=torch.tensor([[3, 7], [2, 5], [1, 3], [4, 7], [1, 2], [3, 6]]),
            role_keys=["g/first", "g/second"] * 3))

    if hasattr(estimator, "state_dict"):
        run([0.0, 1.0, 0.3, 0.9, 0.1, 0.4])
        run([1.0, 0.2, 0.0, 0.6, 0.5, 0.8])
    out = run([1.0, 0.0, 0.5, 0.0, 1.0, 0.2])
    returns = out.returns if out.returns is not None else torch.zeros(0)
    return torch.cat([out.advantages.flatten(), returns.flatten()])


def correction_probe(correction: Callable[[CorrectionInputs], Any]) -> torch.Tensor:
    """The weights and mask a correction puts on the batch's tokens."""
    b = _batch()
    proximal = b["logprobs"] - 0.3 if getattr(correction, "needs_proximal", False) else None
    # KV lags of 0..9 versions: any max_kv_lag in that range masks some tokens and keeps others
    kv_lag = torch.arange(B * T).reshape(B, T) % 10
    out = correction(CorrectionInputs(learner_logprobs=b["logprobs"], behaviour_logprobs=b["behaviour"],
                                      mask=b["mask"], advantages=b["advantages"], proximal_logprobs=proximal,
                                      kv_lag=kv_lag))
    return torch.cat([(out.weights * out.mask).flatten(), out.mask.float().flatten()])


PROBES = {"policy_loss": loss_probe, "advantage_estimator": estimator_probe, "correction": correction_probe}


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.allclose(a, b, rtol=1e-6, atol=1e-9)


CASES = [(kind, name, option, default, is_int) for kind in KINDS for name in registry.names(kind)
         for option, default, is_int in knobs(kind, name)]


def test_the_registry_has_knobs_to_check():
    assert {name for kind, name, *_ in CASES} >= {"ppo", "gspo", "cispo", "grpo", "gae", "tis", "masked_is"}


@pytest.mark.parametrize(("kind", "name", "option", "default", "is_int"), CASES,
                         ids=[f"{k}-{n}-{o}" for k, n, o, *_ in CASES])
def test_each_option_changes_what_it_claims(kind, name, option, default, is_int):
    probe, at = PROBES[kind], f"train.{kind}"
    base_options = context(kind, name, option)
    base = probe(registry.build(kind, name, base_options, field=at))
    tried = []
    for value in changed(default, is_int):
        try:
            plugin = registry.build(kind, name, {**base_options, option: value}, field=at)
            result = probe(plugin)
        except (ConfigError, ValueError, TypeError) as e:  # a value this plugin refuses: try the next
            tried.append(f"{value!r} (refused: {e})")
            continue
        if differs(result, base):
            return
        tried.append(f"{value!r} (no change)")
    pytest.fail(f"{kind} {name!r}: option {option!r} (default {default!r}) changes nothing on the probe batch; "
                f"tried {', '.join(tried)}. Make it act, or declare it metric_only / acts_with "
                f"(tidal.core.plugin_options.declare)")


def test_every_kl_estimator_gives_its_own_gradient():
    """With a KL term, each estimator's gradient differs from every other's (low-var-k3 from k3 where
    its clamp at 10 is reached: the probe's reference is up to 3.5 nats away); a straight-through "+"
    variant has exactly k2's gradient, by design, and its base estimator's value (the logged kl/ref)."""
    plain = [e for e in KL_ESTIMATORS if not e.endswith("+")]
    grads = {e: loss_probe(registry.build("policy_loss", "ppo", {"kl_coef": 0.5, "kl_estimator": e}))
             for e in KL_ESTIMATORS}
    for i, a in enumerate(plain):
        for b in plain[i + 1:]:
            assert differs(grads[a], grads[b]), (a, b)
    b = _batch()
    for e in (e for e in KL_ESTIMATORS if e.endswith("+")):
        assert not differs(grads[e], grads["k2"]), e
        values = [registry.build("policy_loss", "ppo", {"kl_coef": 0.5, "kl_estimator": k})(LossInputs(
            logprobs=b["logprobs"], behaviour_logprobs=b["behaviour"], advantages=b["advantages"], mask=b["mask"],
            ref_logprobs=b["ref"])).metrics["kl/ref"] for k in (e, e[:-1])]
        assert values[0] == values[1], e


def test_an_option_where_it_changes_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"train.loss.options.norm_length.*acts only with agg = "
                                          r"'seq-mean-token-sum-norm' \(here 'token-mean'\)"):
        registry.build("policy_loss", "ppo", {"norm_length": 512.0}, field="train.loss")
    with pytest.raises(ConfigError, match="kl_estimator acts only with kl_coef = a nonzero value"):
        registry.build("policy_loss", "ppo", {"kl_estimator": "k1"}, field="train.loss")
    with pytest.raises(ConfigError, match="rloo.*no option 'eps'"):
        registry.build("advantage_estimator", "rloo", {"eps": 0.1}, field="train.advantage")


# ---------------------------------------------------------------- through the learner's Trainer

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("knobs")
    return build_tiny_model(root / "policy", seed=3), build_tiny_model(root / "reference", seed=4)


def samples(vocab: int) -> list[Sample]:
    """Two groups of four of varied lengths, rewards that differ in each group, behaviour logprobs
    spread around the tiny model's (~ -log vocab) so that ratios cross the clips."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(8):
        t = int(rng.integers(2, 12))
        out.append(Sample(id=str(i), group_id=str(i // 4), prompt=rng.integers(3, vocab, 4).astype(np.int32),
                          completion=rng.integers(3, vocab, t).astype(np.int32),
                          logprobs=(-np.log(vocab) + rng.uniform(-2, 2, t)).astype(np.float32),
                          versions=np.zeros(t, np.int32), reward=float(i % 4 in (0, 3)) + 0.1 * i,
                          loss_mask=np.ones(t, bool)))
    return out


def step_grad(models, loss: str, options: dict[str, Any], *, micro: int = 4096, batch=None,
              metrics: dict[str, float] | None = None) -> torch.Tensor:
    """The gradient one Trainer step hands the optimizer, with the recipe's loss `{name, options}` (and
    the step's metrics into `metrics`, when given)."""
    policy, reference = models
    be = SingleBackend(str(policy), BackendConfig(optim=OptimConfig(lr=1e-3)))
    # a loss that states the advantage it needs (OAPL) is trained with it; every other with the default
    advantage = getattr(registry.build("policy_loss", loss, options), "requires_advantage", None) or "grpo"
    cfg = TrainConfig(loss=PluginRef(name=loss, options=options), advantage=PluginRef(name=advantage),
                      micro_batch_tokens=micro)
    needs_ref = loss == "distillation" or options.get("kl_coef")
    ref = None
    if needs_ref:
        from transformers import AutoModelForCausalLM  # the reference the learner would load

        ref = AutoModelForCausalLM.from_pretrained(reference)
    trainer = Trainer(be, cfg, reference=ref)
    grads: list[torch.Tensor] = []
    trainer.before_update = lambda: grads.append(
        torch.cat([p.grad.flatten() for p in be.model.parameters() if p.grad is not None]).clone())
    out = trainer.step(batch if batch is not None else samples(be.model.config.vocab_size))
    if metrics is not None:
        metrics.update(out)
    return grads[0]


def agg_option(loss: str) -> set[str]:
    """{"agg"} for a loss that takes an aggregation option (not OAPL: its mean over sequences is fixed)."""
    typ = options_type("policy_loss", loss, registry.get("policy_loss", loss))
    return {"agg"} if typ is not None and "agg" in {f.name for f in msgspec.structs.fields(typ)} else set()


# the options the trainer interprets between the recipe and the loss, each with a value to set it to
TRAINER_KNOBS = {"kl_coef": 0.5, "entropy_coef": 0.05, "norm_length": 64.0,
                 **{f"agg={mode}": mode for mode in AGG_MODES}}
POLICY_LOSSES = [n for n in registry.names("policy_loss") if n != "value"]  # value: the critic's, see PPO mode
TRAINER_CASES = [(loss, knob) for loss in POLICY_LOSSES for knob in TRAINER_KNOBS
                 if knob.split("=")[0] in {o for o, *_ in knobs("policy_loss", loss)} | agg_option(loss)]


@pytest.mark.parametrize(("loss", "knob"), TRAINER_CASES, ids=[f"{a}-{b}" for a, b in TRAINER_CASES])
def test_each_option_the_trainer_interprets_changes_the_step(models, loss, knob):
    option, value = knob.split("=")[0], TRAINER_KNOBS[knob]
    base = context("policy_loss", loss, option)
    if option == "agg" and value == default_of("policy_loss", loss, "agg"):  # compare with another mode
        base = {"agg": "token-mean" if value != "token-mean" else "seq-mean-token-mean"}
    assert differs(step_grad(models, loss, {**base, option: value}), step_grad(models, loss, base)), (loss, knob)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_the_step_does_not_depend_on_micro_batching(models, agg):
    """The same gradient from one micro-batch or many, for every aggregation (seq-mean-token-sum-norm
    with no norm_length divides by the step's longest completion, not each micro-batch's)."""
    options = {"agg": agg, "entropy_coef": 0.05, "kl_coef": 0.1}
    one, many = step_grad(models, "ppo", options, micro=4096), step_grad(models, "ppo", options, micro=20)
    assert (one - many).abs().max() <= 1e-5 * one.abs().max(), agg


@pytest.mark.parametrize("agg", ["token-mean", "token-sum"])
def test_the_step_metrics_do_not_depend_on_micro_batching(models, agg):
    """The loss's token averages (ratio, clip fractions, approximate KL) are the batch's however it is
    packed; under token-sum too, where the loss itself adds up over micro-batches. (Under the sequence
    aggregations they are weighed by each micro-batch's sequences, as the loss is: near, not equal.)"""
    one: dict[str, float] = {}
    many: dict[str, float] = {}
    step_grad(models, "ppo", {"agg": agg}, micro=4096, metrics=one)
    step_grad(models, "ppo", {"agg": agg}, micro=20, metrics=many)
    assert many["train/micro_batches"] > 1
    for key in ("ratio/mean", "kl/approx", "clip/high", "clip/low", "loss/total"):
        assert many[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (agg, key)


@pytest.mark.parametrize("loss", ["oapl", "topr"])
def test_a_sequence_mean_loss_step_does_not_depend_on_micro_batching(models, loss):
    """OAPL states its aggregation (a mean over sequences, no `agg` option) and TOPR defaults to one: the
    learner shares each micro-batch by its sequences, so one micro-batch or many give the same step."""
    one, many = step_grad(models, loss, {"kl_coef": 0.1}, micro=4096), step_grad(models, loss, {"kl_coef": 0.1}, micro=20)
    assert (one - many).abs().max() <= 1e-5 * one.abs().max(), loss


def test_the_entropy_bonus_moves_the_weights_with_zero_advantages(models):
    """The defect this file was written for: with every advantage 0, entropy_coef alone must move the
    policy, towards a higher entropy (before, the learner handed the loss a detached entropy, and the
    weights did not move at all)."""
    policy, _ = models
    runs = {}
    for coef in (0.0, 0.05):
        be = SingleBackend(str(policy), BackendConfig(optim=OptimConfig(lr=1e-3)))
        batch = [Sample(id=s.id, group_id="one", prompt=s.prompt, completion=s.completion, logprobs=s.logprobs,
                        versions=s.versions, reward=1.0, loss_mask=s.loss_mask)
                 for s in samples(be.model.config.vocab_size)]  # one group, one reward: GRPO's advantages are 0
        trainer = Trainer(be, TrainConfig(loss=PluginRef(name="ppo", options={"entropy_coef": coef})))
        before = {k: v.clone() for k, v in be.named_weights()}
        entropies = [trainer.step(batch)["train/entropy"] for _ in range(4)]
        runs[coef] = (max((v - before[k]).abs().max().item() for k, v in be.named_weights()), entropies)
    assert runs[0.0][0] == 0.0, runs  # nothing to learn without the bonus
    moved, entropies = runs[0.05]
    assert moved > 1e-4, runs
    assert entropies[-1] > entropies[0], runs
