"""A run's recipe: one TOML file that says what to train, on what, and how the roles are laid out.

    name = "arith"
    model = "/models/tiny-sft"
    group_size = 8
    batch_groups = 8
    [[domains]]
    env = { name = "arithmetic", options = { level = 2 } }
    [learner.train.loss]
    name = "grpo"

The role sections (`rollout`, `buffer`, `learner`) are exactly the configs of those processes
(`python -m tidal.rollout.worker.process --help` and friends), so a setting has one name everywhere. The
launcher fills in what must agree between roles: endpoints, model folder, group size, batch size, seeds.
`tidal run RECIPE.toml learner.backend.options.optim.lr=1e-4` overrides any field by its dotted name. Every
plugin choice has the one shape `{ name = "...", options = { ... } }` (older spellings are refused by
`tidal.integration.old_spellings`, with the new form).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from tidal.algos.plugin import GREEDY_BASELINE
from tidal.buffer.config import BufferConfig
from tidal.core.config import (
    ConfigStruct,
    Domain,
    PluginRef,
    apply_overrides,
    convert,
    domains_by_key,
    read_config,
)
from tidal.core.episodes import is_episodic
from tidal.core.errors import ConfigError
from tidal.core.plugin_failure import build_failure
from tidal.core.plugin_options import fit
from tidal.core.plugins import registry
from tidal.integration.learner.objective import Objective
from tidal.integration.old_spellings import migrate_run_config, refuse_old_spellings
from tidal.learner.config import LearnerConfig, TrainConfig
from tidal.rollout.episodes.process import register_plugins
from tidal.rollout.worker.config import WorkerConfig

log = logging.getLogger("tidal.recipe")


class SamplingConfig(ConfigStruct):
    temperature: float = 1.0  # of training samples; must be > 0 (a greedy sample carries no policy gradient)
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off
    top_k: int = -1  # keep the k likeliest tokens; -1 = off
    max_tokens: int = 64  # tokens per completion; in a multi-turn episode per turn (rollout.episodes.max_tokens caps the sample)
    # generation ends once the completion's text contains any of these strings (the token completing one is
    # kept); one that the tokenizer writes as a single token is checked as a stop token id, at no decoding cost
    stop: list[str] = msgspec.field(default_factory=lambda: ["\n"])
    # record, per sampled token, the vocabulary top-k/top-p kept: the learner renormalises over exactly
    # that set (Keep Sampling Mask) instead of recomputing the cut. Costs vocab/8 bytes per token on the wire
    return_sampling_mask: bool = False
    # record, per token, the MoE experts the sampler used (MoE models): the learner reports how often its
    # router disagrees (moe/router_mismatch) and, with learner.moe.replay, sends tokens to those experts
    return_routing: bool = False


class EvalConfig(ConfigStruct):
    every: int = 5  # evaluate held-out problems every N policy versions (and at the start and the end); 0 = never
    size: int = 200  # held-out problems per domain
    temperature: float = 0.0  # 0 = greedy
    max_tokens: int = 0  # 0 = sampling.max_tokens
    # how long the run waits, after the learner's last step, for evaluations still running; then it ends
    # anyway and final.json says so
    final_timeout_s: float = 120.0


class BudgetConfig(ConfigStruct):
    versions: int = 100  # policy versions (learner steps) to train; the run ends after the last
    minutes: float = 0.0  # stop earlier after this much wall-clock; 0 = no limit


class MonitorConfig(ConfigStruct):
    progress: Literal["auto", "rich", "log", "off"] = "auto"  # auto = rich on a terminal, log lines otherwise
    tensorboard: bool = True  # also write TensorBoard event files under <run_dir>/tb
    log_every_s: float = 10.0  # period of the one-line status in "log" mode


class LaunchConfig(ConfigStruct):
    heartbeat_timeout_s: float = 60.0  # a worker silent this long (and alive) is killed and restarted
    max_restarts: int = 3  # per role; a role that dies more often ends the run
    shutdown_timeout_s: float = 30.0  # how long roles get to stop before they are killed
    start_timeout_s: float = 300.0  # how long the run waits for every worker's first request
    # no new policy version for this long (or 20x the median time per version, if longer) ends the run
    # with status "stalled" and each role's last error; 0 = never
    stall_timeout_s: float = 300.0
    # no training group could be trained on (every one dropped: verifier errors, failed episodes...) for
    # this long after the first worker connected: the run ends "failed: no group could be scored in N s: ..."
    # with the top cause; 0 = never
    no_trainable_group_s: float = 60.0
    # a run that completed with almost no trained sample carrying a learning signal (every group's rewards
    # equal: tidal.integration.signal_watch) ends "learned nothing: ..." and `tidal run` exits 3; false: it
    # ends "completed" (the console's warning still comes), for runs that test plumbing on an untrained model
    fail_without_signal: bool = True
    # more than this share of the training groups dropped over `drop_rate_window_s` is a warning in the
    # driver log with its top cause, and a `drop_rate` event in metrics.jsonl (once per window)
    max_drop_rate: float = 0.5
    drop_rate_window_s: float = 60.0
    # torch threads per learner rank and rollout worker; 0 = this machine's cores shared out by load: half
    # to the learner's ranks (its step is the critical path once generation runs ahead), the rest split
    # over the workers, at least one each
    threads: int = 0
    # CURVE on every channel of the run (keys per role in RUN_DIR/keys; each server lets in only the run's
    # roles that use it, and checks which role sends what). Off: plaintext, and any local process can push
    # data into the buffer, take or acknowledge batches and stop it (a warning says so)
    auth: bool = True
    # before any role starts, build each domain's environment in the driver and draw its first train and
    # eval task, so that a plugin that fails to build (a missing lazily imported module) is refused in one
    # line naming the field, the plugin and the author's file and line. false: for an environment slow to
    # build; its errors then surface when the controller builds it, after the run folder is made
    check_envs: bool = True


class SelfPlayConfig(ConfigStruct):
    """Self-play: who plays the seats of a multi-role (game) domain that the live policy does not."""

    # an `opponent` plugin (`tidal plugins opponent`): mirror, lagged, pool, fixed; unset = not a self-play
    # run (a multi-role domain is then played by the live policy in every seat, as mirror would)
    opponent: PluginRef | None = None
    # who the held-out games are played against: "scripted" (the environment's scripted player: a fixed
    # yardstick, so eval/accuracy is the win-rate against it), "live", or "v<version>"
    eval_opponent: str = "scripted"


class RunConfig(ConfigStruct):
    name: str = "run"  # the run's name: its default folder and its reports
    run_dir: str = ""  # "" = runs/<name>-<date>-<time>
    mode: Literal["async", "sync"] = "async"  # sync: the same roles in lock-step (generate, train, sync)
    launcher: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="local"))
    model: str = ""  # local Hugging Face folder (learner and workers start from it)
    seed: int = 0  # seeds the task streams (domain i draws with seed + i), the sampler and the learner
    group_size: int = 8  # G samples per prompt
    batch_groups: int = 8  # groups per learner step
    # depth gate: no sample is more than this many versions old when trained (async); also the `max_lag` of
    # a `buffer.admission = { name = "version_rejection" }` that does not set its own
    max_staleness: int = 2
    domains: list[Domain] = msgspec.field(default_factory=lambda: [Domain()])
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    budget: BudgetConfig = msgspec.field(default_factory=BudgetConfig)
    workers: int = 2  # rollout worker processes
    rollout: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    monitor: MonitorConfig = msgspec.field(default_factory=MonitorConfig)
    launch: LaunchConfig = msgspec.field(default_factory=LaunchConfig)
    selfplay: SelfPlayConfig = msgspec.field(default_factory=SelfPlayConfig)

    @property
    def batch_samples(self) -> int:
        return self.group_size * self.batch_groups


_DOMAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def recipes_dir() -> Path:
    """The recipes that ship with tidal: integration/recipes/ in a checkout (an editable install reads them
    there), copied into the wheel as tidal/integration/recipes/ (integration/pyproject.toml, force-include)."""
    packaged = Path(__file__).parent / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[3] / "recipes"


def load_recipe(path: str | Path | None, overrides: Sequence[str] = (), *, run_folder: bool = False) -> RunConfig:
    cfg = read_recipe(path, overrides, run_folder=run_folder)
    check(cfg)
    return cfg


def read_recipe(path: str | Path | None, overrides: Sequence[str] = (), *, run_folder: bool = False) -> RunConfig:
    """The recipe at `path` (None: defaults) with `overrides` applied, decoded but not checked; a plugin
    choice spelt the old way is refused first, with its new form. `run_folder`: `path` is a run folder's
    config.json, whose old spellings an earlier Tidal wrote: they are carried over (and logged) instead."""
    data, source = read_config(path)
    if run_folder:
        for line in migrate_run_config(data):
            log.warning("%s was written by an earlier Tidal: read with %s", source, line)
    refuse_old_spellings(data, overrides, source)
    return convert(apply_overrides(data, overrides), RunConfig, source=source)


def _check_domains(cfg: RunConfig) -> None:
    """At least one domain, each with a positive weight and a name of its own fit for group ids."""
    if not cfg.domains:
        raise ConfigError("`domains` is empty: name at least one environment", field="domains")
    if any(d.weight <= 0 for d in cfg.domains):
        raise ConfigError("every domain needs a positive `weight`", field="domains")
    for i, d in enumerate(cfg.domains):
        if not _DOMAIN_NAME.fullmatch(d.key):
            raise ConfigError(f"domains[{i}].name {d.key!r} must be letters, digits, '_', '-' or '.' "
                              f"(it is part of group ids and metric names)", field=f"domains[{i}].name")
    domains_by_key(cfg.domains)  # each name once


def check(cfg: RunConfig) -> None:
    """Errors a run would otherwise meet minutes in, named by field."""
    if not cfg.model:
        raise ConfigError("`model` is empty: give a local Hugging Face folder (tidal demo builds one)", field="model")
    if not Path(cfg.model).is_dir():
        raise ConfigError(f"model folder {cfg.model} does not exist: give a local Hugging Face folder "
                          f"(`tidal demo` builds a tiny one)", field="model")
    for name, value, low in (("group_size", cfg.group_size, 1), ("batch_groups", cfg.batch_groups, 1),
                             ("workers", cfg.workers, 1), ("budget.versions", cfg.budget.versions, 1),
                             ("max_staleness", cfg.max_staleness, 0)):
        if value < low:
            raise ConfigError(f"`{name}` must be at least {low}, got {value}", field=name)
    if cfg.learner.train.advantage.name in GREEDY_BASELINE and cfg.group_size < 2:
        raise ConfigError(f"`group_size` = {cfg.group_size} with advantage {cfg.learner.train.advantage.name!r}: each "
                          f"group is G - 1 sampled completions and one greedy baseline, so G must be at least 2",
                          field="group_size")
    _check_domains(cfg)
    if cfg.sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature must be > 0 for training samples, got {cfg.sampling.temperature:g}: "
                          f"a greedy sample carries no policy gradient (eval.temperature may be 0)",
                          field="sampling.temperature")
    lr = cfg.learner.backend.options.optim.lr
    if lr < 0:
        raise ConfigError(f"learner.backend.options.optim.lr must be >= 0, got {lr:g}: a negative learning rate "
                          f"climbs the loss (typical: 1e-6 to 1e-4)", field="learner.backend.options.optim.lr")
    nonnegative: list[tuple[str, float, str]] = [
        ("budget.minutes", cfg.budget.minutes, "no time limit"), ("eval.every", cfg.eval.every, "never evaluate"),
        ("learner.backend.options.optim.warmup_steps", cfg.learner.backend.options.optim.warmup_steps, "no warmup")]
    for field, got, zero in nonnegative:
        if got < 0:
            raise ConfigError(f"`{field}` must be >= 0 (0 = {zero}), got {got:g}", field=field)
    if cfg.learner.keep_checkpoints < 1:
        raise ConfigError(f"learner.keep_checkpoints must be >= 1 (1 = <checkpoints>/latest alone), got "
                          f"{cfg.learner.keep_checkpoints}", field="learner.keep_checkpoints")
    if cfg.learner.checkpoint_every < 0:
        raise ConfigError(f"learner.checkpoint_every must be >= 0, got {cfg.learner.checkpoint_every}",
                          field="learner.checkpoint_every")
    for name, value, default, source in set_by_the_run(cfg):
        if value != default and value != source[0]:
            raise ConfigError(f"`{name}` = {value!r} in the recipe, but the run sets it ({source[1]}): "
                              f"remove it{source[2]}", field=name)
    if cfg.learner.moe.replay and not cfg.sampling.return_routing:
        raise ConfigError("learner.moe.replay replays the routing the sampler recorded: set "
                          "sampling.return_routing = true too", field="learner.moe.replay")
    if cfg.learner.weights.every < 1:
        raise ConfigError("learner.weights.every must be >= 1 for a run: the generators need the new weights",
                          field="learner.weights.every")
    _check_lag_by_design(cfg)
    check_plugins(cfg)
    if cfg.launch.check_envs:
        for i in range(len(cfg.domains)):
            check_env(cfg, i, preflight_env(cfg, i))


def _check_lag_by_design(cfg: RunConfig) -> None:
    """Publishing every L steps (`learner.weights.every = L`, OAPL's setting) trains on samples up to L - 1
    versions old by design: the depth gate must let generation run that far ahead of the sampler's weights,
    or the learner waits for a batch the gate will not grant before it publishes, and the run stalls."""
    every = cfg.learner.weights.every
    if every > cfg.max_staleness + 1:
        raise ConfigError(f"learner.weights.every = {every} publishes every {every} steps, so samples are up to "
                          f"{every - 1} versions old when trained, but max_staleness = {cfg.max_staleness} lets "
                          f"generation run only {cfg.max_staleness} versions ahead of the weights it holds: the "
                          f"learner would wait for a batch the depth gate never grants. Set max_staleness >= "
                          f"{every - 1}", field="max_staleness")
    a = cfg.buffer.admission
    max_lag = a.options.get("max_lag") if a is not None and a.name == "version_rejection" else None
    if isinstance(max_lag, int) and max_lag < every - 1:
        raise ConfigError(f"buffer.admission.options.max_lag = {max_lag} drops every sample more than {max_lag} "
                          f"versions old, but learner.weights.every = {every} trains on samples up to {every - 1} "
                          f"versions old by design: raise max_lag to >= {every - 1} (or leave it out: it follows "
                          f"max_staleness)", field="buffer.admission.options.max_lag")


def check_models(cfg: RunConfig) -> None:
    """The recipe's model folders hold Hugging Face models (`tidal run` checks this before the run folder is
    made; `check` alone only needs them to exist, so the driver's parts can be tested without a model)."""
    for name, folder in (("model", cfg.model), ("learner.model", cfg.learner.model), ("rollout.model", cfg.rollout.model)):
        if folder:
            check_model_folder(folder, name)


def check_model_folder(folder: str | Path, field: str = "model") -> None:
    """A folder that exists but holds no Hugging Face model (config, weights, tokenizer) is refused in one
    line that names what is missing, before a role loads it (a transformers traceback minutes in)."""
    p = Path(folder)
    if not p.is_dir():
        raise ConfigError(f"`{field}`: model folder {p} does not exist", field=field)
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any(any(p.glob(g)) for g in ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise ConfigError(f"`{field}` = {str(folder)!r} is not a Hugging Face model folder: no {', no '.join(missing)} "
                          f"in it (give the folder that save_pretrained wrote; `tidal demo` builds a tiny one)",
                          field=field)


def preflight_env(cfg: RunConfig, i: int):
    """Build domain `i`'s environment and draw its first train task (and eval task, when the run
    evaluates), as the controller will: what fails here fails before any process starts, as one
    `ConfigError` naming `domains[i]`. The controller builds its own instance afterwards, on purpose: the
    draws made here must not shift the run's task stream."""
    d = cfg.domains[i]
    try:
        env = registry.build("env", d.env.name, d.env.options, field=f"domains[{i}].env")
    except ConfigError as e:
        if "domains[" in str(e):
            raise
        # an error from a plugin the env builds itself (its tools, its parser), which names only its own field
        raise ConfigError(f"`domains[{i}].env.options` of env {d.env.name!r}: {e}",
                          field=f"domains[{i}].env.options") from e
    splits = ("train", "eval") if cfg.eval.every and cfg.eval.size else ("train",)
    for split in splits:
        try:
            first = next(iter(env.tasks(split, cfg.seed + i)), None)
        except Exception as e:
            raise build_failure("env", d.env.name, registry.get("env", d.env.name), e, field=f"domains[{i}].env",
                                doing=f"make its first {split} task") from e
        if first is None and split == "train":  # an eval stream may be short, even empty; a train one never
            raise ConfigError(f"domains[{i}]: env {d.env.name!r} made no train task (its tasks(\"train\", "
                              f"{cfg.seed + i}) yielded nothing): a training stream must never end",
                              field=f"domains[{i}]")
    return env


def check_env(cfg: RunConfig, i: int, env) -> None:
    """Multi-turn domains score with their episodes' own verifier (a domain `reward` plugin would be
    ignored), record no routing and no sampling masks yet (a sample's observation tokens are never
    sampled, so they have neither) and have no greedy baseline member (ReMax's advantage): a recipe asking
    for any of these with such a domain is refused."""
    d = cfg.domains[i]
    if not is_episodic(env):
        return
    if cfg.learner.train.advantage.name in GREEDY_BASELINE:
        raise ConfigError(f"domains[{i}] ({d.env.name!r}) is multi-turn, and its episodes have no greedy baseline "
                          f"member, which advantage {cfg.learner.train.advantage.name!r} needs: choose another "
                          f"learner.train.advantage (rloo, grpo, ...)", field="learner.train.advantage")
    asks = [f for f in ("return_routing", "return_sampling_mask") if getattr(cfg.sampling, f)]
    if d.reward is not None:
        raise ConfigError(f"domains[{i}] ({d.env.name!r}) is multi-turn: its episodes' outcome is the reward, so "
                          f"the reward plugin {d.reward.name!r} would never run; remove domains[{i}].reward",
                          field=f"domains[{i}].reward")
    if asks:
        raise ConfigError(f"domains[{i}] ({d.env.name!r}) is multi-turn, and multi-turn samples record no "
                          f"{' or '.join(asks)} yet: set sampling.{asks[0]} = false, or train this domain "
                          f"in a recipe of its own", field=f"sampling.{asks[0]}")


def _check_objective(train: TrainConfig) -> None:
    """The pairings a loss states of itself (OAPL needs its advantage and takes no correction), refused here
    as the learner would refuse them, before any role starts. Builds the loss: imports torch."""
    try:
        Objective.build(train)
    except ConfigError as e:
        raise ConfigError(str(e).replace("train.", "learner.train."),
                          field=f"learner.{e.field}" if e.field else None) from None


def check_plugins(cfg: RunConfig) -> None:
    """Every plugin the recipe names exists and its options fit the options it declares
    (`tidal.core.plugin_options`): checked in the driver, before any role starts, so that a misspelt
    name or option is a `ConfigError` naming its field, not a role that dies minutes in."""
    # local plugin modules the recipe names (rollout.episodes.plugins): the driver, its controller, the
    # workers and their environment processes all import them
    register_plugins(cfg.rollout.episodes.plugins)
    for i, d in enumerate(cfg.domains):
        registry.check("env", d.env.name, d.env.options, field=f"domains[{i}].env")
        if d.reward is not None:
            registry.check("reward", d.reward.name, d.reward.options, field=f"domains[{i}].reward")
    t = cfg.learner.train
    refs: list[tuple[str, PluginRef | None, str]] = [
        ("launcher", cfg.launcher, "launcher"), ("engine", cfg.rollout.engine, "rollout.engine"),
        ("policy_loss", t.loss, "learner.train.loss"), ("advantage_estimator", t.advantage, "learner.train.advantage"),
        ("correction", t.correction, "learner.train.correction"), ("admission", cfg.buffer.admission, "buffer.admission"),
        *(("group_filter", f, f"buffer.filters[{i}]") for i, f in enumerate(cfg.buffer.filters)),
        ("renderer", cfg.rollout.episodes.renderer, "rollout.episodes.renderer"),
    ]
    for kind, ref, field in refs:
        if ref is not None:
            registry.check(kind, ref.name, ref.options, field=field)
    _check_objective(t)
    # the backend's options are typed (BackendConfig, checked when decoded); its name is checked here
    registry.check("train_backend", cfg.learner.backend.name, {}, field="learner.backend")
    sender = cfg.learner.weights.transport
    registry.check("weight_transport", sender.name, {}, field="learner.weights.transport")
    fit(sender.options, registry.create("weight_transport", sender.name).sender_options(),
        field="learner.weights.transport.options", what=f"weight transport {sender.name!r} (its sender)")
    try:  # a name listed twice is refused
        cfg.rollout.receiver_options()
    except ConfigError as e:
        raise ConfigError(f"rollout.{e}", field=f"rollout.{e.field}") from None
    for i, r in enumerate(cfg.rollout.weight_transport):
        at = f"rollout.weight_transport[{i}]"
        registry.check("weight_transport", r.name, {}, field=at)
        fit(r.options, registry.create("weight_transport", r.name).receiver_options(),
            field=f"{at}.options", what=f"weight transport {r.name!r} (its receiver)")


def set_by_the_run(cfg: RunConfig):
    """(field, the recipe's value, its section's default, (what the run sets, from where, what to do))
    for every role field that the launcher fills in so that the roles agree: a recipe that sets one of
    them to something else is refused, never silently overridden."""
    b, lr, w = BufferConfig(), LearnerConfig(), WorkerConfig()
    endpoint = (None, "a loopback endpoint picked for each run", "")
    yield from (
        ("buffer.group_size", cfg.buffer.group_size, b.group_size, (cfg.group_size, "from `group_size`", "; set `group_size`")),
        ("buffer.batch_samples", cfg.buffer.batch_samples, b.batch_samples,
         (cfg.batch_samples, "group_size x batch_groups", "; set `batch_groups`")),
        ("learner.max_steps", cfg.learner.max_steps, lr.max_steps, (cfg.budget.versions, "from `budget.versions`",
                                                                    "; set `budget.versions`")),
        ("learner.seed", cfg.learner.seed, lr.seed, (cfg.seed, "from `seed`", "; set `seed`")),
        ("learner.train.temperature", cfg.learner.train.temperature, lr.train.temperature,
         (cfg.sampling.temperature, "from `sampling.temperature`: the learner recomputes logprobs as sampled",
          "; set `sampling.temperature`")),
        ("buffer.ingest", cfg.buffer.ingest, b.ingest, endpoint), ("buffer.serve", cfg.buffer.serve, b.serve, endpoint),
        ("buffer.publish", cfg.buffer.publish, b.publish, endpoint),
        ("learner.buffer", cfg.learner.buffer, lr.buffer, endpoint),
        ("learner.publish", cfg.learner.publish, lr.publish, endpoint),
        ("rollout.name", cfg.rollout.name, w.name, (None, "rollout-0 .. rollout-N", "")),
        ("rollout.controller", cfg.rollout.controller, w.controller, endpoint),
        ("rollout.buffer_ingest", cfg.rollout.buffer_ingest, w.buffer_ingest, endpoint),
        ("rollout.buffer_acks", cfg.rollout.buffer_acks, w.buffer_acks, endpoint),
        ("rollout.weights", cfg.rollout.weights, w.weights, endpoint),
        ("rollout.weights_server", cfg.rollout.weights_server, w.weights_server,
         (None, "the learner, or with launcher.options.weights_relay each node's relay", "")),
        ("rollout.domains", cfg.rollout.domains, w.domains,
         (cfg.domains, "from the top-level `[[domains]]`", "; list each domain under the top-level `[[domains]]`")),
        ("learner.snapshot_every", cfg.learner.snapshot_every, lr.snapshot_every,
         (None, "from `selfplay.opponent` (its `every`)", "; set the opponent's `every`")),
        ("learner.snapshot_dir", cfg.learner.snapshot_dir, lr.snapshot_dir,
         (None, "<run_dir>/snapshots with `selfplay.opponent`", "")),
        ("rollout.episodes.snapshot_dir", cfg.rollout.episodes.snapshot_dir, w.episodes.snapshot_dir,
         (None, "<run_dir>/snapshots with `selfplay.opponent`", "")),
    )
    if cfg.mode == "sync":
        yield ("learner.weights.every", cfg.learner.weights.every, lr.weights.every,
               (1, "sync mode publishes every version", "; or use mode = \"async\""))


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
