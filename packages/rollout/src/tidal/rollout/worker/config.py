"""The rollout worker's configuration (`python -m tidal.rollout.worker.process --help`): what a recipe's
`[rollout]` section holds."""

from __future__ import annotations

from typing import Any

import msgspec

from tidal.core.config import ConfigStruct, Domain, PluginRef
from tidal.core.errors import ConfigError
from tidal.core.protocol import TOPIC_WEIGHTS
from tidal.core.security import ChannelSecurity
from tidal.rollout.episodes.multiturn import EpisodesConfig
from tidal.rollout.worker.transcripts import TranscriptsConfig


class WorkerConfig(ConfigStruct):
    name: str = "rollout-0"  # unique within the run; the buffer acknowledges to this name
    controller: str = "tcp://127.0.0.1:5610"  # controller ROUTER (assignments, heartbeats, metrics)
    buffer_ingest: str = "tcp://127.0.0.1:5601"  # buffer PULL (trajectories)
    buffer_acks: str = "tcp://127.0.0.1:5603"  # buffer PUB (acks on topic ack/<name>/)
    # PUB endpoint announcing WeightsAvailable ("" = only via the controller); "{node}" in it is this
    # machine's name in the run (tidal.core.net.on_this_node: a node's relay socket)
    weights: str = ""
    weights_topic: str = TOPIC_WEIGHTS  # topic prefix of the announcements there ("" = every message)
    # the role whose key announces weights there (with a run's keys): the learner, or the weight relay
    # of this worker's node (tidal.weight_sync.relay; its zmq receiver then names it as `server` too)
    weights_server: str = "learner"
    model: str = ""  # local Hugging Face folder (also the tokenizer used to decode completions)
    engine: PluginRef = msgspec.field(default_factory=lambda: PluginRef(name="embedded"))
    # the domains an Assignment.task names (by `name`, else the env's name; each once), and what scores
    # them: [{ env = { name = "countdown", options = { ... } } }]. A run fills it from the recipe's
    # `[[domains]]`. A single-turn task not listed here is an environment plugin of that name with its
    # default options (a standalone worker's convenience); the environment processes of multi-turn tasks
    # serve the listed domains only
    domains: list[Domain] = []
    # receiver options per weight transport, e.g. [{ name = "zmq", options = { timeout = 60.0 } }]; a
    # transport not listed receives with its defaults (the learner's announcement names the transport)
    weight_transport: list[PluginRef] = []
    max_groups: int = 4  # prompt groups held at once (generating + awaiting buffer acks)
    heartbeat_interval_s: float = 1.0
    metrics_interval_s: float = 5.0
    resend_after_s: float = 5.0  # trajectory resend period while unacknowledged
    stop_timeout_s: float = 30.0  # how long a stop waits for in-flight trajectories to be acknowledged
    connect_timeout_s: float = 120.0  # how long to wait for the controller's answer to our Hello
    # one small generation (a group of 8, 4 tokens each) before saying Hello: the engine's first-call costs
    # (allocations, kernel choices) are paid while the other roles start, not by the first batch the
    # learner waits for; 0 skips it
    warmup_samples: int = 8
    episodes: EpisodesConfig = msgspec.field(default_factory=EpisodesConfig)  # multi-turn (episodic) domains
    # a sample of what the model wrote, as readable transcripts (`tidal samples RUN_DIR`)
    transcripts: TranscriptsConfig = msgspec.field(default_factory=TranscriptsConfig)
    # a run's CURVE keys (tidal run fills it): this worker's key and the driver's, buffer's and learner's
    # public keys; unset = plaintext (loopback only)
    security: ChannelSecurity = msgspec.field(default_factory=ChannelSecurity)
    # append every trajectory id the buffer acknowledged to this file, one per line, as the ack arrives
    # (audits and fault tests: the producer's own record of what the buffer promised to keep);
    # "{name}" is replaced by the worker's name; "" = no record
    acked_log: str = ""

    def receiver_options(self) -> dict[str, dict[str, Any]]:
        """`weight_transport` by name (what the engines' receivers take); a name listed twice is refused."""
        return _by_name(self.weight_transport, "weight_transport")

    def domain(self, name: str) -> Domain:
        """The listed domain whose key is `name`; else the environment plugin `name` with its defaults."""
        for d in self.domains:
            if d.key == name:
                return d
        return Domain(env=PluginRef(name=name))


def _by_name(refs: list[PluginRef], field: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, ref in enumerate(refs):
        if ref.name in out:
            raise ConfigError(f"{field}[{i}] names {ref.name!r} again: list each once", field=f"{field}[{i}].name")
        out[ref.name] = dict(ref.options)
    return out


__all__ = ["WorkerConfig"]
