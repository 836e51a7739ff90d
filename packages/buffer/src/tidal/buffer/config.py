"""Buffer configuration (the `[buffer]` section of a run, or a TOML file of its own)."""

from __future__ import annotations

from typing import Literal

import msgspec

from tidal.core.config import ConfigStruct, PluginRef
from tidal.core.security import ChannelSecurity


class BufferConfig(ConfigStruct):
    # endpoints
    ingest: str = "tcp://127.0.0.1:5601"  # PULL: trajectories from rollout workers
    serve: str = "tcp://127.0.0.1:5602"  # ROUTER: batch requests and acks from learner ranks; status
    publish: str = "tcp://127.0.0.1:5603"  # PUB: trajectory acks (topic ack/<source>/) and metrics
    curve_secret_key: str = ""  # server key pair file; required when an endpoint is not loopback
    curve_authorized_keys: str = ""  # folder of client public keys allowed in ("" = any holder of our key)
    # a run's keys (tidal run fills it): ingest lets in roles of kind "rollout", serve "learner" and
    # "driver" (stop from the driver only), publish "rollout" and "driver"; unset = plaintext (loopback)
    security: ChannelSecurity = msgspec.field(default_factory=ChannelSecurity)

    # groups
    group_size: int = 8  # G, unless a trajectory says otherwise
    group_timeout_s: float = 600.0  # an incomplete group older than this is dropped or released
    incomplete: Literal["drop", "release"] = "drop"  # what happens to a timed-out group

    # depth
    max_groups: int = 256  # bounded mode: stop ingesting while this many complete groups wait; 0 = unbounded
    batch_samples: int = 64  # samples per learner step (over all ranks), whole groups
    batch_tokens: int = 0  # if > 0, size steps by prompt + completion tokens instead

    # admission and filtering
    admission: PluginRef | None = None  # staleness policy (e.g. version_rejection); also applied when serving
    filters: list[PluginRef] = []  # group filters applied to complete groups (e.g. zero_variance)

    # durability
    wal_dir: str = "buffer-wal"  # write-ahead log folder
    fsync: Literal["always", "batch", "never"] = "batch"  # when acknowledged data is fsynced
    max_batch_records: int = 512  # group commit: fsync once this many records wait for it...
    commit_interval_s: float = 0.005  # ...or once the oldest has waited this long (acks go out after)
    compact_bytes: int = 256 * 1024**2  # compact the log when it grows past this
    dedupe_window: int = 1_000_000  # consumed trajectory ids remembered to refuse late resends (the last half to all of them)

    # limits: ZeroMQ drops a frame over these unread (MAXMSGSIZE), the codec refuses a message over them
    max_message_bytes: int = 256 * 1024**2  # ingest: the largest Trajectory / TrajectoryGroup message, all frames
    max_request_bytes: int = 1024**2  # serve: BatchRequest, batch Acks, Control (a few KiB each)

    # validation: a trajectory failing these is refused (a negative Ack names why; counted refused/<reason>)
    vocab_size: int = 0  # token ids must lie in [0, vocab_size); 0 = unchecked (`tidal run` fills it from the model)
    # a token's version may be at most this much newer than the learner version the buffer knows (workers run
    # weights the learner published, so only a forged or corrupt trajectory is ahead); -1 = unchecked. Not
    # checked until the learner's first BatchRequest after the buffer starts (the version is not persisted).
    version_slack: int = 64
    max_abs_reward: float = 1e4  # |reward| above this is refused; 0 = unchecked (finiteness is always checked)
    # a BatchRequest moves the learner version forward by at most this much (a larger claim is counted as
    # errors/version_jump and clamped); the first request after the buffer starts sets it; -1 = unbounded
    max_version_step: int = 64

    # observability
    metrics_interval_s: float = 2.0  # period of Metrics messages on the PUB socket
    hwm: int = 1000  # ZeroMQ high-water mark on every socket
