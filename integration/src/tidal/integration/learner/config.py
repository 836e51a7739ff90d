"""The learner's settings (``[learner]`` in a recipe, or a TOML file and dotted overrides for
``python -m tidal.integration.learner``)."""

from __future__ import annotations

import msgspec

from tidal.core.config import ConfigStruct
from tidal.integration.learner.backends import BackendConfig
from tidal.integration.learner.parallel import ParallelConfig
from tidal.integration.learner.trainer import TrainConfig


class MoEOptions(ConfigStruct):
    # the learner's forward sends every completion token to the experts its sampler used (the routing
    # recorded in Trajectory.routing: needs sampling.return_routing); the routing-mismatch metrics are
    # reported either way whenever routing was recorded
    replay: bool = False


class WeightsConfig(ConfigStruct):
    transport: str = "zmq"  # weight transport plugin: zmq, shm, fs, torch_dist, ...
    options: dict[str, object] = {}  # WeightSender options (bucket_bytes, delta, endpoint, ...)
    every: int = 1  # publish after every N steps; 0 = never
    final_wait_s: float = 30.0  # at exit, keep serving the last version until a generator reports it (zmq, shm)
    reannounce_s: float = 2.0  # re-announce the latest version this often, for generators that (re)joined late


class LearnerConfig(ConfigStruct):
    model: str = ""  # local Hugging Face folder to start from
    reference_model: str = ""  # frozen reference for a KL penalty / distillation; "" = the starting model
    backend: str = "single"  # train_backend plugin: single, fsdp2, ...
    backend_options: BackendConfig = msgspec.field(default_factory=BackendConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    buffer: str = "tcp://127.0.0.1:5602"  # buffer ROUTER (batch requests, acks)
    publish: str = "tcp://127.0.0.1:5620"  # PUB bound by rank 0: weight announcements and metrics
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    moe: MoEOptions = msgspec.field(default_factory=MoEOptions)
    # sequence parallelism { sp = P, sp_mode = "ulysses" | "ring" | "hybrid" }: the ranks form dp x sp, each
    # packed row split over the P ranks of an SP group (tidal-seqpar); ep: expert parallelism
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    checkpoint_dir: str = ""  # resume from <dir>/latest when present; "" = no checkpoints
    # steps between checkpoints (with checkpoint_dir); trained batches are acknowledged to the buffer at
    # each one, so a learner killed in between is served them again on resume; 0 = only at the end
    # (batches acknowledged each step; under `tidal run` a learner that fails then ends the run, as there
    # is no checkpoint to restart it from)
    checkpoint_every: int = 10
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
