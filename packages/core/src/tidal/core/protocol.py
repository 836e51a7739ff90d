"""The Tidal wire protocol: every message any two Tidal processes exchange.

Each message is a msgspec Struct in one tagged union (`Message`), encoded as a msgpack array
(`array_like=True`: field order is the schema, so fields are only ever appended, with defaults).
Arrays are `tidal.core.arrays.Array`: small ones inline, large ones as extra zero-copy frames; see
`tidal.core.codec` for the frame layout and the version preamble that every message carries.

Compatibility rule: a new optional field at the end of a message, or a new message type, bumps
PROTOCOL_MINOR; anything else bumps PROTOCOL_MAJOR, and peers of different majors refuse each other.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tidal.core.arrays import Array

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 7  # 1: TrajectoryGroup, Ack.refused, Batch.ready_at; 2: Ack.reason, Assignment.prompt/.domain,
#                     SamplingParams.stop, Trajectory.sampling; 3: Ack.version, Error.protocol;
#                     4: EpisodeOpen/EpisodeStep/EpisodeClose/EpisodeReply (environment processes);
#                     5: Trajectory.kv_versions; 6: BASELINE_KEY (a greedy member asked by metadata);
#                     7: WeightsAvailable.lora_scale, EpisodeReply.restart/.text, multi-role episodes
#                        (EpisodeReply.role/.roles/.outcomes, Ack.scores)
PROTOCOL_VERSION: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)


class _Msg(msgspec.Struct, tag=True, array_like=True, gc=False, omit_defaults=True):
    """Base of every wire message (tag = class name)."""


class _Part(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of structs nested inside messages (no tag)."""


# --------------------------------------------------------------------------- vocabulary
# The names every package uses on the wire, defined once here: publish/subscribe topics, what an `Ack`
# acknowledges, and how ids are built from each other. Nothing outside this module spells them.

TOPIC_METRICS = "metrics"  # `Metrics` (learner, buffer): what the driver plots and the controller reads
TOPIC_WEIGHTS = "weights"  # `WeightsAvailable` (learner rank 0): a new policy version to fetch

AckKind = Literal["trajectory", "group", "batch", "weights", "assignment", "control"]
ACK_TRAJECTORY: AckKind = "trajectory"  # buffer -> producer: these trajectories are durable
ACK_GROUP: AckKind = "group"  # buffer -> producer: these groups are durable (Ack.refused: members refused)
ACK_BATCH: AckKind = "batch"  # learner -> buffer: these batches are trained (and the buffer's reply)
ACK_WEIGHTS: AckKind = "weights"  # generator -> weight server: version `Ack.version` applied (or refused)
ACK_ASSIGNMENT: AckKind = "assignment"  # worker -> controller: this group is done (durable, dropped, or eval)
ACK_CONTROL: AckKind = "control"  # a `Control` command carried out (ids: the command)


# The version of a completion token the policy did not sample (an observation, a tool's output, an
# environment's text inside a multi-turn sample): such a token also has logprob 0 and loss_mask 0, and
# staleness admission, lag metrics, IS weights, KL and entropy skip it.
NO_VERSION = -1

# Assignment.metadata key asking for a greedy baseline member (value "greedy"; ReMax's advantage): the last
# of its num_samples is decoded greedily (temperature 0). That member's Trajectory alone keeps the key in
# its metadata, has loss_mask 0 everywhere and is scored like the others; the learner reads its reward as
# its group's baseline and trains on the other members only.
BASELINE_KEY = "tidal.baseline"


def group_id(domain: str, n: int) -> str:
    """The id of the `n`-th training group the controller hands out for `domain` (unique in a run)."""
    return f"{domain}-{n:07d}"


def eval_group_id(version: int, domain: str, index: int) -> str:
    """The id of held-out problem `index` of `domain` in the evaluation of policy `version`."""
    return f"eval{version}-{domain}-{index:04d}"


def trajectory_id(group_id: str, index: int) -> str:
    """The id of sample `index` of group `group_id`."""
    return f"{group_id}:{index}"


def segment_id(trajectory_id: str, k: int) -> str:
    """The id of segment `k` of a multi-turn sample that had to be split (segment 0 keeps the sample's id)."""
    return trajectory_id if k == 0 else f"{trajectory_id}.{k}"


def group_of(trajectory_id: str) -> str:
    """The group id a trajectory id was built from (`trajectory_id`'s inverse)."""
    return trajectory_id.rsplit(":", 1)[0]


# --------------------------------------------------------------------------- handshake & errors


class Hello(_Msg):
    """First message on a request/reply connection, sent by each side; majors must match."""

    role: str  # what the sender is: "rollout", "buffer", "learner", "controller", "client", ...
    name: str  # unique name of the sender within the run, e.g. "rollout-3"
    # (major, minor) wire protocol the sender speaks. No default on purpose: omit_defaults would
    # drop it from the wire and the peer would read its own version instead.
    protocol: tuple[int, int]
    software: dict[str, str] = {}  # distribution name -> version, for diagnostics
    pid: int = 0  # sender's process id, for diagnostics
    host: str = ""  # sender's host name, for diagnostics


class Error(_Msg):
    """A refusal or failure reported to the peer that caused it."""

    code: str  # machine-readable kind: "protocol", "version", "refused", "internal", ...
    detail: str  # human-readable explanation: what was wrong and what to do
    ref: str = ""  # id of the message this answers, when there is one
    protocol: tuple[int, int] = (0, 0)  # code "version": the protocol the refusing side speaks


class Ack(_Msg):
    """Acknowledges messages by id: durable trajectories, consumed batches, applied weights."""

    kind: str  # what is acknowledged: an `AckKind` (ACK_TRAJECTORY, ACK_GROUP, ...; str so that a newer kind decodes)
    ids: list[str]  # ids of the acknowledged items (trajectory, group, batch ids; "v<version>" for weights)
    ok: bool = True  # False: the items were received but rejected (see `detail`)
    detail: str = ""  # why they were rejected, when ok is False
    # kind "group" with ok True: members of the acknowledged groups that were refused one by one (stale),
    # trajectory id -> why; every other member is durable
    refused: dict[str, str] = {}
    # machine-readable kind of failure when ok is False, for drop-by-reason counts: "score_error",
    # "decode_error", "reward_error", "abort", "refused", ... ("" = unspecified)
    reason: str = ""
    version: int = -1  # kind "weights": the policy version applied (or refused); -1 = not about a version
    # kind "assignment" with ok True: samples of the group left out (failed episodes of a group trained on its
    # survivors, each with every seat it would have trained; a game's seat that never moved): settled, never
    # delivered; `detail` then says why the first failed episode was left out
    left_out: int = 0
    # kind "assignment" with ok True, a multi-role (self-play) group: the live policy's reward in each of its
    # episodes (1 a win, ...), which the controller's opponent sampler rates the group's opponent by
    scores: list[float] = []


# --------------------------------------------------------------------------- control plane


class Heartbeat(_Msg):
    """Liveness signal; a role that misses several is presumed dead and restarted."""

    role: str  # sender's role
    name: str  # sender's unique name
    seq: int  # increments by one per heartbeat from this sender
    time: float  # sender's wall clock (time.time()) when sent
    version: int = -1  # policy version the sender holds, -1 when not applicable
    status: dict[str, float] = {}  # small gauges worth seeing live: queue depth, in-flight, ...


ControlCommand = Literal["pause", "resume", "stop", "drain", "checkpoint", "status"]


class Control(_Msg):
    """A command from the controller (or launcher) to a role."""

    command: ControlCommand  # what to do
    reason: str = ""  # why, for the logs
    version: int = -1  # policy version the command refers to, when relevant
    args: dict[str, str] = {}  # command-specific options


class Metrics(_Msg):
    """Numbers a role reports for plotting: one step's scalars and optional histograms."""

    source: str  # reporting role name, e.g. "learner-0"
    step: int  # step counter of the source (policy version for the learner)
    time: float  # wall clock when measured
    scalars: dict[str, float]  # metric name -> value, names slash-separated ("loss/policy")
    histograms: dict[str, Array] = {}  # metric name -> 1-D array of samples (e.g. lag per sample)


# --------------------------------------------------------------------------- data plane


class SamplingParams(_Part):
    """How to sample a completion. Defaults are plain ancestral sampling."""

    temperature: float = 1.0  # softmax temperature; logprobs are reported after it
    top_p: float = 1.0  # nucleus mass kept; 1.0 disables
    top_k: int = -1  # number of top tokens kept; -1 disables
    max_tokens: int = 256  # most completion tokens generated
    stop_token_ids: list[int] = []  # generation ends after any of these tokens
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token (benchmarks)
    seed: int | None = None  # per-request seed for reproducible sampling
    return_sampling_mask: bool = False  # record which vocab entries top-k/top-p kept
    return_routing: bool = False  # record MoE expert ids per token per layer
    # generation ends once the decoded completion contains any of these strings; the token that
    # completes one is kept and nothing is cut inside a token, so the trained tokens are exactly the
    # sampled ones (the text may run a little past the stop string). Single-token stops belong in
    # stop_token_ids, which costs no decoding.
    stop: list[str] = []


class Assignment(_Msg):
    """Controller -> rollout worker: generate one group of samples for one prompt."""

    group_id: str  # unique id of the group; every sample of it carries this id
    prompt_ids: Array  # int32 [prompt_len] prompt token ids
    num_samples: int  # G: how many samples to generate for this prompt
    task: str  # the recipe domain whose environment (and reward) scores the samples: its name, by default the env plugin name
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)  # how to sample
    answer: str = ""  # reference answer or task payload the environment verifies against
    metadata: dict[str, str] = {}  # free task metadata passed through to the trajectories
    prompt: str = ""  # the prompt text as the environment wrote it (its `score` sees the task whole)
    domain: str = ""  # Task.domain as the environment set it ("" = `task`)


class WorkRequest(_Msg):
    """Rollout worker -> controller: ready for `want` more prompt groups (credit-based flow control:
    the controller never sends more assignments than were asked for)."""

    want: int  # number of further Assignments the worker can take now
    version: int = -1  # policy version the worker's engine holds
    running: int = 0  # groups the worker is generating or delivering


class Trajectory(_Msg):
    """One sampled completion with everything the learner needs to train on it."""

    id: str  # unique and stable across resends, so receivers can deduplicate
    group_id: str  # prompt group this sample belongs to (G samples share it)
    sample_index: int  # index of this sample within its group, 0..G-1
    task: str  # the recipe domain (by default its env plugin name) that produced the reward
    prompt_ids: Array  # int32 [prompt_len] prompt token ids
    completion_ids: Array  # int32 [completion_len] generated token ids
    logprobs: Array  # float32 [completion_len] logprob of each token under the sampler's processed distribution
    versions: Array  # int32 [completion_len] policy version that produced each token (NO_VERSION: not sampled)
    reward: float  # scalar reward of the whole completion
    finish_reason: str  # "stop", "length", "abort", ...
    step_rewards: Array | None = None  # float32 [num_steps] per-step (process) rewards, if any
    step_ends: Array | None = None  # int32 [num_steps] completion index where each step ends (exclusive)
    loss_mask: Array | None = None  # uint8 [completion_len] 0 = not trained on (tool output, env text)
    routing: Array | None = None  # uint8/int16 [completion_len, layers, top_k] MoE expert ids chosen at sampling
    sampling_mask: Array | None = None  # packed bits [completion_len, ceil(vocab/8)] of vocab entries kept
    metadata: dict[str, str] = {}  # free metadata from the task or the worker
    source: str = ""  # name of the rollout worker that produced it; the buffer acks to this name
    group_size: int = 0  # G of its group; 0 = the buffer's configured group size
    # how its tokens were sampled (temperature, top-k, top-p): the learner recomputes each token's
    # logprob under exactly this processing; None = unknown (a producer older than protocol 1.2)
    sampling: SamplingParams | None = None
    # int32 [completion_len]: per token, the oldest policy version that wrote the KV cache it attended to
    # when it was sampled (<= versions; older under in-flight updates with partial_mode "continue"), so the
    # learner can see KV staleness beside sampling staleness; NO_VERSION where not sampled. None = the
    # producer did not record it (older than protocol 1.5, or an engine that cannot tell)
    kv_versions: Array | None = None


class TrajectoryGroup(_Msg):
    """A finished group of samples in one message: the buffer admits, logs, acknowledges (under `id`) and
    serves it as one unit. Each member's arrays travel as they would in a lone `Trajectory` (inline, or as
    zero-copy frames of this message when large)."""

    id: str  # the group id: unique and stable across resends; the buffer's Ack names it
    trajectories: list[Trajectory]  # the samples, each with its own id and group_id == id
    source: str = ""  # name of the producer; the buffer acks to this name


class Batch(_Msg):
    """Buffer -> learner rank: trajectories to train on, identified for acknowledgement."""

    batch_id: str  # unique id; the learner acks it once trained so the buffer can forget it
    rank: int  # data-parallel rank this share is for
    world_size: int  # number of data-parallel ranks the batch was split across
    trajectories: list[Trajectory]  # the samples, complete groups unless partial release is on
    step: int = -1  # learner step this batch is meant for, when the buffer knows it
    num_tokens: int = 0  # total prompt + completion tokens in this share
    ready_at: float = 0.0  # buffer's wall clock when this share was formed (its groups complete); 0 = unknown


class BatchRequest(_Msg):
    """Learner rank -> buffer: ask for the next batch share."""

    rank: int  # requesting data-parallel rank
    world_size: int  # data-parallel world size
    version: int  # policy version the learner currently holds (for admission against lag)
    max_samples: int = 0  # cap on samples in the reply; 0 = buffer's configured batch size
    max_tokens: int = 0  # cap on tokens in the reply; 0 = no token cap
    acked: list[str] = []  # batch ids trained since the last request (saves a separate Ack round trip)
    # the newest batch id this rank holds unacknowledged (it acknowledges at its checkpoints): serve the
    # share after it; "" = serve the oldest unacknowledged share (a rank that restarted gets it again)
    after: str = ""


class TensorSpec(_Part):
    """One tensor of a weight transfer: where its bytes sit and how to check them."""

    name: str  # parameter name as the receiving model expects it
    dtype: str  # dtype name (tidal.core.arrays.ITEMSIZE keys)
    shape: tuple[int, ...]  # full (unsharded) shape
    bucket: int = 0  # index of the bucket that carries the bytes
    offset: int = 0  # byte offset inside the bucket
    nbytes: int = 0  # byte length inside the bucket
    encoding: str = "dense"  # "dense", or "delta" (index + value pairs against the previous version)


class WeightsAvailable(_Msg):
    """Learner -> generators: a new policy version can be fetched over the named transport."""

    version: int  # policy version of these weights; strictly increasing
    transport: str  # weight transport plugin name: "zmq", "torch_dist", "shm", "fs", ...
    manifest: list[TensorSpec]  # every tensor of the update, in bucket order
    bucket_sizes: list[int] = []  # byte size of each bucket
    checksums: list[int] = []  # per-bucket checksum (crc32 / xxhash as named in `checksum`)
    checksum: str = "crc32"  # checksum algorithm name
    base_version: int = -1  # for delta updates: version the delta applies to; -1 = full weights
    location: str = ""  # transport-specific address: endpoint, shm name, folder, group name
    lora_only: bool = False  # True when only LoRA adapter tensors are included
    # lora_only: the adapters' scale (alpha / rank); a receiver's layer weight is W + lora_scale * B @ A.
    # 0 = not given (a sender of an older release): the receiver must be told the scale otherwise
    lora_scale: float = 0.0


class WeightsRequest(_Msg):
    """Receiver -> weight sender (pull transports): send me one bucket of a version."""

    version: int  # the announced version being fetched
    bucket: int  # bucket index in the announcement's manifest
    have_version: int = -1  # version the receiver holds (a delta against it may be sent); -1 = none


class WeightsBucket(_Msg):
    """Weight sender -> receiver: the bytes of one bucket (an out-of-line frame, zero-copy)."""

    version: int  # version these bytes belong to
    bucket: int  # bucket index
    data: Array  # uint8 [nbytes] packed tensors (dense) or the delta encoding of them
    encoding: str = "dense"  # "dense" or "delta" (against the receiver's copy of `base_version`)
    base_version: int = -1  # for delta: the version the delta applies to


# --------------------------------------------------------------------------- episodes
# Rollout worker's environment pool (ROUTER) <-> environment processes (DEALER, one identity per start):
# one episode per sample, stepped in turn.


class ChatMessage(_Part):
    """One message of a conversation, as a renderer shows it to the model."""

    role: str  # "system", "user", "assistant", "tool"
    content: str  # its text
    name: str = ""  # for role "tool": the tool that produced it


class ToolSpec(_Part):
    """A tool the model may call, as renderers and chat templates describe it."""

    name: str  # what the model writes to call it
    description: str = ""  # one line for the model
    parameters: dict[str, Any] = {}  # JSON-schema-like object: {"type": "object", "properties": {...}}


class EpisodeOpen(_Msg):
    """Worker -> environment process: start an episode of `domain` for this task."""

    episode_id: str  # unique in the run (a trajectory id); replies name it
    domain: str  # the recipe domain (or environment plugin name) the process was configured with
    prompt: str  # the task's prompt, as `Task` carries it
    answer: str = ""  # the task's reference answer (the verifier's)
    metadata: dict[str, str] = {}  # the task's free data


class EpisodeStep(_Msg):
    """Worker -> environment process: the text the model produced in turn `seq`."""

    episode_id: str  # the episode, as opened
    seq: int  # 1 for the first action; the reply echoes it (a late reply to an older step is ignored)
    action: str  # the decoded text of the sampled tokens of this turn
    role: str = "agent"  # who acted (one role until self-play)


class EpisodeClose(_Msg):
    """Worker -> environment process: forget this episode (finished, dropped or abandoned)."""

    episode_id: str  # the episode to forget


class EpisodeReply(_Msg):
    """Environment process -> worker: the answer to an `EpisodeOpen` (seq 0) or an `EpisodeStep`."""

    episode_id: str  # the episode answered
    seq: int  # 0: the answer to EpisodeOpen (first observation, tools); else the step it answers
    messages: list[ChatMessage] = []  # the observation (empty when done)
    token_ids: list[int] | None = None  # an observation given as tokens instead of messages
    reward: float = 0.0  # this step's reward
    done: bool = False  # the episode is over (no more steps)
    outcome: float | None = None  # the final reward, present when done (None with an error)
    info: dict[str, float] = {}  # step counters: tool_calls, tool_errors, ...
    tools: list[ToolSpec] = []  # seq 0: the tools of this episode
    max_turns: int = 0  # seq 0: actions allowed
    stop: list[str] = []  # seq 0: strings that end a turn holding a tool call (kept in the sampled text)
    error: str = ""  # "" = ok; else what failed (the episode is over, and it is not a zero reward)
    # from the environment process: "env_error" (the environment raised), "verifier_error" (outcome()
    # raised, or a reward is not a real finite number), "unknown_episode", "bad_request"; synthesized by the
    # pool: "timeout" (this episode's request got no answer within step_timeout_s: its process is killed),
    # "env_restarted" (another episode's request got stuck and the pool killed the process: this one is not
    # at fault, and may be retried), "env_died" (the process died by itself while serving it)
    error_kind: str = ""
    restart: bool = False  # `messages` is the whole conversation anew (an agent rewrote it): the sample splits
    text: str | None = None  # an observation of plain text, appended as it is (tokenised alone, no renderer)
    # multi-role episodes (self-play): the role that acts next, shown this observation ("" = the only role)
    role: str = ""
    roles: list[str] = []  # seq 0: the episode's roles (seats), in turn order; [] = one role
    outcomes: dict[str, float] = {}  # when done, a multi-role episode's reward of each role (`outcome` is unset)


Message = (
    Hello
    | Error
    | Ack
    | Heartbeat
    | Control
    | Metrics
    | Assignment
    | WorkRequest
    | Trajectory
    | TrajectoryGroup
    | Batch
    | BatchRequest
    | WeightsAvailable
    | WeightsRequest
    | WeightsBucket
    | EpisodeOpen
    | EpisodeStep
    | EpisodeClose
    | EpisodeReply
)

MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Hello,
    Error,
    Ack,
    Heartbeat,
    Control,
    Metrics,
    Assignment,
    WorkRequest,
    Trajectory,
    TrajectoryGroup,
    Batch,
    BatchRequest,
    WeightsAvailable,
    WeightsRequest,
    WeightsBucket,
    EpisodeOpen,
    EpisodeStep,
    EpisodeClose,
    EpisodeReply,
)

__all__ = [
    "ACK_ASSIGNMENT",
    "ACK_BATCH",
    "ACK_CONTROL",
    "ACK_GROUP",
    "ACK_TRAJECTORY",
    "ACK_WEIGHTS",
    "BASELINE_KEY",
    "MESSAGE_TYPES",
    "NO_VERSION",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "TOPIC_METRICS",
    "TOPIC_WEIGHTS",
    "Ack",
    "AckKind",
    "Assignment",
    "Batch",
    "BatchRequest",
    "ChatMessage",
    "Control",
    "ControlCommand",
    "EpisodeClose",
    "EpisodeOpen",
    "EpisodeReply",
    "EpisodeStep",
    "Error",
    "Heartbeat",
    "Hello",
    "Message",
    "Metrics",
    "SamplingParams",
    "TensorSpec",
    "ToolSpec",
    "Trajectory",
    "TrajectoryGroup",
    "WeightsAvailable",
    "WeightsBucket",
    "WeightsRequest",
    "WorkRequest",
    "eval_group_id",
    "group_id",
    "group_of",
    "segment_id",
    "trajectory_id",
]
