"""The learner's settings (``[learner]`` in a recipe, or a TOML file and dotted overrides for
``python -m tidal.integration.learner``). The backend, train and parallel sections describe Tidal's own
backends and step (tidal.integration.learner); a learner built on this package with a backend and step
of its own reads the rest."""

from __future__ import annotations

from typing import Literal

import msgspec

from tidal.core.config import ConfigStruct, PluginRef
from tidal.core.security import ChannelSecurity

# No torch here: a recipe is checked (`tidal run` with a misspelt field) without importing it.


class ParallelConfig(ConfigStruct):
    sp: int = 1  # sequence-parallel degree (tidal-seqpar)
    sp_mode: Literal["ulysses", "ring", "hybrid"] = "ulysses"
    ep: int = 1  # expert-parallel degree (tidal-moe-fsdp)


class OptimConfig(ConfigStruct):
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    warmup_steps: int = 0
    schedule: str = "constant"  # "constant", "linear" or "cosine" decay after warmup
    total_steps: int = 1000  # for the decaying schedules
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr


class BackendConfig(ConfigStruct):
    dtype: str = "float32"  # parameter dtype of the model
    mixed_precision: str = ""  # fsdp2: compute dtype ("bfloat16"), params kept in `dtype`; "" = off
    # "auto": flash_attention_2 on GPU when installed, else tidal_varlen (packed rows cost what their
    # sequences cost, see tidal.seqpar.varlen); or any transformers name: "sdpa", "eager", ...
    attn: str = "auto"
    grad_checkpointing: bool = False
    value_head: bool = False  # PPO: a scalar critic head on the last hidden state (trained, never published)
    # Hugging Face sparse MoE blocks (Mixtral / Qwen3-MoE layout) become tidal-moe-fsdp MoEBlocks (same
    # parameter names, dropless): what routing replay and the routing-mismatch metric need
    moe_blocks: bool = True
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)


class BackendChoice(ConfigStruct):
    """The train_backend plugin, in the shape of every plugin choice (`tidal.core.config.PluginRef`) but with
    typed options, so a misspelt one is refused by field: backend = { name = "fsdp2", options = { dtype =
    "bfloat16", optim = { lr = 1e-5 } } }; overridden as learner.backend.options.optim.lr=1e-4."""

    name: str = "single"  # train_backend plugin: single, fsdp2, ... (`tidal plugins train_backend`)
    options: BackendConfig = msgspec.field(default_factory=BackendConfig)


class TrainConfig(ConfigStruct):
    loss: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="ppo"))
    advantage: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="grpo"))
    correction: PluginRef | None = None  # staleness correction, e.g. {name = "tis", options = {cap = 2.0}}
    # the sampler's temperature for trajectories that do not carry their own sampling parameters (older
    # producers); every other trajectory is recomputed under the processing it records (Trajectory.sampling)
    temperature: float = 1.0
    micro_batch_tokens: int = 4096  # packed tokens per forward; gradients accumulate over micro-batches
    # a group's samples share their prompt in the packed row (computed once, not G times); needs the
    # backend's attention to be tidal_varlen (attn "auto" on CPU), ignored otherwise
    share_prompts: bool = True
    # the policy a loss's ratio (or OAPL's regression) is anchored to for a token sampled by an older
    # version: "sampler", the logprobs the sampler recorded; "learner", recomputed by the learner with the
    # very weights it published as that version (kept in memory from then: the newest `lag_snapshots`;
    # older tokens fall back to the sampler's, counted in staleness/lag_logprobs_from_sampler), as OAPL's
    # paper does: the anchor then carries no sampler-vs-learner numerical mismatch. One process, no SP
    lag_logprobs: Literal["sampler", "learner"] = "sampler"
    lag_snapshots: int = 2  # with lag_logprobs = "learner": published versions kept (each a model copy)
    value_coef: float = 0.5  # PPO mode (advantage "gae"): weight of the critic's value loss
    value_clip: float = 0.2  # PPO value clipping; 0 disables it


class MoEOptions(ConfigStruct):
    # the learner's forward sends every completion token to the experts its sampler used (the routing
    # recorded in Trajectory.routing: needs sampling.return_routing); the routing-mismatch metrics are
    # reported either way whenever routing was recorded
    replay: bool = False


class WeightsConfig(ConfigStruct):
    # weight transport plugin (zmq, shm, fs, torch_dist, ...) and its WeightSender options (bucket_bytes,
    # delta, endpoint, ...): transport = { name = "shm", options = { delta = true } }
    transport: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="zmq"))
    every: int = 1  # publish after every N steps; 0 = never
    final_wait_s: float = 30.0  # at exit, keep serving the last version until a generator reports it (zmq, shm)
    reannounce_s: float = 2.0  # re-announce the latest version this often, for generators that (re)joined late


class LoraOptions(ConfigStruct):
    """`learner.lora`: train low-rank adapters (PEFT's LoRA) instead of the full weights. Only the adapters
    get gradients and optimizer state, checkpoints hold them, and generators are sent them alone (the
    announcement carries `alpha / rank`, the scale of W + scale * B @ A)."""

    rank: int = 8  # r: the adapters' inner dimension
    alpha: float = 16.0  # scale = alpha / rank
    # module names (the last part of the path) that get adapters: Linear layers only
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    dropout: float = 0.0  # on the adapters' input while training (the learner's logprobs become noisy above 0)

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.alpha > 0 or not self.target_modules or not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora needs rank >= 1, alpha > 0, at least one of target_modules and "
                             f"0 <= dropout < 1; got rank={self.rank}, alpha={self.alpha}, "
                             f"target_modules={self.target_modules}, dropout={self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LearnerConfig(ConfigStruct):
    model: str = ""  # local Hugging Face folder to start from
    reference_model: str = ""  # KL penalty's frozen reference, or distillation's teacher (same tokenizer); "" = the starting model
    # train_backend plugin and its typed options: { name = "fsdp2", options = { dtype = "bfloat16" } }
    backend: BackendChoice = msgspec.field(default_factory=BackendChoice)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    buffer: str = "tcp://127.0.0.1:5602"  # buffer ROUTER (batch requests, acks)
    # where batches come from: "buffer" (the run's buffer, at `buffer`), or "replay" with
    # options = { path = "DIR" }: the batches a learner recorded there (record_batches), in order, no buffer
    source: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="buffer"))
    record_batches: str = ""  # a folder: every batch trained is appended there as served, for a replay
    publish: str = "tcp://127.0.0.1:5620"  # PUB bound by rank 0: weight announcements and metrics
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    # a run's CURVE keys (tidal run fills it): the buffer's public key; publish lets in the "rollout" and
    # "driver" roles; unset = plaintext (loopback only)
    security: ChannelSecurity = msgspec.field(default_factory=ChannelSecurity)
    moe: MoEOptions = msgspec.field(default_factory=MoEOptions)
    # sequence parallelism { sp = P, sp_mode = "ulysses" | "ring" | "hybrid" }: the ranks form dp x sp, each
    # packed row split over the P ranks of an SP group (tidal-seqpar); ep: expert parallelism
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    # LoRA { rank, alpha, target_modules, dropout }: adapters train, the base weights stay frozen; unset =
    # full fine-tuning. The single backend, one rank (fsdp2, deepspeed, sp and ep refuse it for now)
    lora: LoraOptions | None = None
    checkpoint_dir: str = ""  # resume from <dir>/latest when present; "" = no checkpoints
    # steps between checkpoints (with checkpoint_dir); trained batches are acknowledged to the buffer at
    # each one, so a learner killed in between is served them again on resume; 0 = only at the end
    # (batches acknowledged each step; under `tidal run` a learner that fails then ends the run, as there
    # is no checkpoint to restart it from)
    checkpoint_every: int = 10
    # checkpoints kept: 1 = <checkpoint_dir>/latest alone; N > 1 = also the newest N as step-<step> folders
    # (hard links: `latest` costs nothing beside the newest of them). The learner does not see held-out
    # accuracy (the driver evaluates), so it keeps by age; `tidal export --checkpoint best` picks among them
    keep_checkpoints: int = 1
    # when the learner stops cleanly (its last step, or SIGTERM / SIGINT), the policy is written here as a
    # Hugging Face folder (safetensors, config, tokenizer, generation config); "" = not written.
    # `tidal run` sets it to <run_dir>/model
    export_dir: str = ""
    # self-play: frozen snapshots of the policy every N versions (and version 0 at a fresh start), written
    # as <snapshot_dir>/v<version>.safetensors (whole weights, a LoRA run's merged) for the rollout workers
    # to play against; 0 = none. `tidal run` sets both from the recipe's `selfplay.opponent`
    snapshot_every: int = 0
    snapshot_dir: str = ""
    max_steps: int = 0  # stop after this many steps; 0 = run until stopped
    simulate_s_per_sample: float = 0.0  # benchmarks only: extra sleep per trained sample (tools/bench/pipeline.py)
    record_trained_ids: bool = False  # keep every trained trajectory id in the checkpoint (audits, fault tests)
    batch_timeout_s: float = 600.0  # how long to wait for the buffer to have a batch
    # one process: ask for the next batch and pack it (and its advantages, without a critic) on a thread
    # while this step trains, so a batch the buffer already holds costs the step nothing; its acks go
    # with the request after. Ignored with several ranks (their batch exchange is collective)
    prefetch: bool = True
    wait_for_subscriber_s: float = 0.0  # before the first step, wait this long for a metrics subscriber (a driver)
    device: str = "cpu"
    seed: int = 0
