"""What an implementation of each plugin kind must offer, as `typing.Protocol`s.

These let sibling packages use each other's implementations by name without importing each other:
rollout asks the registry for a weight receiver, the buffer for a staleness policy, the learner for a
loss. Tensors are typed loosely (`Tensor = Any`) because tidal.core never imports torch; the
implementing package documents shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from tidal.core.protocol import SamplingParams, Trajectory, WeightsAvailable

Tensor = Any  # a torch.Tensor in the implementing package; core never imports torch
NamedTensors = Iterable[tuple[str, Tensor]]


# --------------------------------------------------------------------------- engines


class GenerationRequest(msgspec.Struct, kw_only=True):
    """One prompt to complete."""

    request_id: str  # caller's id; results and aborts refer to it
    prompt_ids: list[int]  # prompt token ids
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)  # how to sample


class GenerationResult(msgspec.Struct, kw_only=True):
    """A finished (or aborted) completion."""

    request_id: str  # the request's id
    completion_ids: list[int]  # generated token ids
    logprobs: list[float]  # logprob of each token under the processed distribution it was drawn from
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop", "length", "abort"
    sampling_mask: Any = None  # per-token kept-vocabulary bitmask, when requested
    routing: Any = None  # per-token MoE expert ids per layer, when requested
    # per token, the oldest policy version in the KV cache it attended to (Trajectory.kv_versions);
    # None = the engine cannot tell
    kv_versions: list[int] | None = None


@runtime_checkable
class Engine(Protocol):
    """Generates completions with continuous batching; weights can change between decode steps."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    def submit(self, request: GenerationRequest) -> None: ...

    def poll(self, timeout: float | None = None) -> list[GenerationResult]:
        """Results finished since the last call (waits up to `timeout` for at least one)."""
        ...

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        """Load new weights between two decode steps; later tokens carry `version`."""
        ...

    def receive_weights(self, announcement: WeightsAvailable) -> int:
        """Fetch an announced version through the weight transport it names (found in the plugin
        registry, kind ``weight_transport``), verify it and load it in flight; returns the version now
        held. An engine whose model lives in another process (vLLM) receives there, without a copy
        through this one."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def load_state(self) -> Mapping[str, float]:
        """Gauges for heartbeats and metrics: "running", "waiting", "last_update_pause_s", ..."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- environments, rewards


class Task(msgspec.Struct, kw_only=True):
    """One problem an environment poses."""

    prompt: str  # text shown to the model
    answer: str = ""  # reference answer or payload the verifier checks against
    domain: str = ""  # task family, for per-domain metrics and mixing
    metadata: dict[str, str] = {}  # free task data


@runtime_checkable
class Environment(Protocol):
    """Makes tasks and scores completions (single turn)."""

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """An endless (train) or finite (eval) stream of tasks for `split` ("train" / "eval")."""
        ...

    def score(self, task: Task, completion: str) -> float:
        """Reward of `completion` for `task`."""
        ...


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An agent loop: the model acts, the environment answers, until done."""

    def reset(self, task: Task) -> str:
        """First observation (text appended to the prompt)."""
        ...

    def step(self, action: str) -> tuple[str | None, float, bool]:
        """(observation to append or None, reward of this step, done)."""
        ...


RewardFn = Callable[[Task, str], float]


# --------------------------------------------------------------------------- algorithms


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Per-token advantages [B, T] from rewards; see tidal-algos for the exact inputs.

    Optional attribute ``needs_values: bool`` (absent = False): it reads a critic's per-token values, so
    the learner trains a value head (GAE). Optional ``uses_step_rewards: bool`` (absent = False): it reads
    the process rewards of multi-turn samples (`Trajectory.step_rewards` at `.step_ends`); the learner
    hands them to no other estimator (and says once that they are ignored)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor: ...


@runtime_checkable
class PolicyLoss(Protocol):
    """Loss from a `LossInputs` (per-token tensors) to a `LossOutputs` (scalar loss + metrics).

    Optional attribute ``reads_reference: bool`` (absent = False): it reads a frozen reference model's
    logprobs (a KL penalty, distillation), so the learner loads one."""

    def __call__(self, inputs: Any, /) -> Any: ...


@runtime_checkable
class GroupFilter(Protocol):
    """Decides whether a complete group of trajectories goes to training (True) or is dropped.
    Runs inside the buffer, which has no torch: implementations must not need it."""

    def __call__(self, group: Sequence[Trajectory], /) -> bool: ...


# --------------------------------------------------------------------------- staleness


class Admission(msgspec.Struct, kw_only=True):
    """What a staleness policy decided about one trajectory."""

    admit: bool  # False: drop the whole trajectory
    token_mask: list[bool] | None = None  # per completion token, False = masked out; None = all kept
    reason: str = ""  # why it was dropped or trimmed, for drop-by-reason metrics


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Admits, trims or drops a trajectory given its per-token policy versions (the buffer: no torch)."""

    def admit(self, versions: Sequence[int], current_version: int) -> Admission: ...


@runtime_checkable
class CorrectionPolicy(Protocol):
    """Reweights and masks the loss's tokens for the lag between sampler and learner (the learner):
    `tidal.staleness.correction.CorrectionInputs` in, `Correction` (weights, mask, metrics) out.

    Optional attribute ``needs_proximal: bool`` (absent = False): it needs the learner's pre-update
    logprobs as the proximal policy (decoupled PPO)."""

    def __call__(self, inputs: Any, /) -> Any: ...


# --------------------------------------------------------------------------- weight sync


@runtime_checkable
class WeightSender(Protocol):
    """Learner side: publishes a named set of tensors as one version."""

    def send(self, weights: NamedTensors, version: int) -> WeightsAvailable: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Generator side: fetches an announced version and hands (name, tensor) pairs to `apply`."""

    def receive(self, announcement: WeightsAvailable, apply: Callable[[NamedTensors], None]) -> int:
        """Fetch, verify and apply; returns the version now held. Keeps the old one on failure."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightTransport(Protocol):
    """A way to move weights; the registry maps a transport name to one of these."""

    def sender(self, config: Mapping[str, Any]) -> WeightSender: ...

    def receiver(self, config: Mapping[str, Any]) -> WeightReceiver: ...

    def sender_options(self) -> type:
        """The msgspec Struct that `sender(config)`'s config must fit (checked before a run starts)."""
        ...

    def receiver_options(self) -> type:
        """The msgspec Struct that `receiver(config)`'s config must fit."""
        ...


# --------------------------------------------------------------------------- training and launching


@runtime_checkable
class TrainBackend(Protocol):
    """Owns the model and its parallelism for the learner's `Trainer` (tidal.integration.learner): packed
    forward passes, gradient accumulation, the optimizer step, checkpoint state and weight export. Tensors
    are torch's; tidal-core only describes the seam. Built as ``factory(model, cfg, device, **options)``.

    Attributes the trainer and the learner read: ``cfg`` (its BackendConfig: `value_head`, `attn`, ...),
    ``model`` (the wrapped module), ``attention`` (transformers' attention name of the policy),
    ``reduces_grads`` (backward/step reduce gradients over the ranks: sharded backends),
    ``native_checkpoints`` (checkpoints through `save_native` / `load_native`, not torch.distributed.checkpoint).
    """

    cfg: Any
    model: Any
    reduces_grads: bool
    native_checkpoints: bool

    @property
    def attention(self) -> str: ...

    def forward(self, input_ids: Any, position_ids: Any, layout: Any = None, keep: Any = None) -> Any:
        """Logits [1, L, V] of a packed row (positions restart per sequence), or at the row positions `keep`."""
        ...

    def forward_with_values(self, input_ids: Any, position_ids: Any, layout: Any = None) -> tuple[Any, Any]:
        """(logits, critic values [1, L]) of a packed row; needs the config's value head."""
        ...

    def layout_kw(self, layout: Any) -> dict[str, Any]:
        """Forward keyword arguments that carry a packed row's layout to the attention in use."""
        ...

    def backward(self, loss: Any, last: bool) -> None:
        """Accumulate one micro-batch's gradient (`last`: the step's final micro-batch)."""
        ...

    def clip_and_step(self) -> Mapping[str, float]:
        """Clip gradients, step the optimizer and the LR schedule, zero gradients; metrics (grad norm, lr)."""
        ...

    def named_weights(self) -> NamedTensors:
        """Full (unsharded) weights, gathered one tensor at a time, for weight sync (collective)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state for torch.distributed.checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_native(self, path: str) -> None:
        """Write a checkpoint in the backend's own format (when `native_checkpoints`)."""
        ...

    def load_native(self, path: str) -> None: ...


@runtime_checkable
class RunHandle(Protocol):
    """The running roles of one run, by role name. The run driver decides what to restart."""

    def exited(self) -> dict[str, int]:
        """Roles that ended since the last call -> exit code (negative: killed by that signal)."""

    def running(self, name: str) -> bool: ...

    def restart(self, name: str) -> None: ...

    def kill(self, name: str) -> None: ...

    def signal(self, name: str, sig: int) -> None: ...

    def stop(self, order: Sequence[str], timeout: float, only: bool = False) -> dict[str, int]:
        """SIGTERM the roles in `order` (then, unless `only`, the rest), SIGKILL after `timeout`."""


@runtime_checkable
class Launcher(Protocol):
    """Starts the roles of a run (each one command: ``python -m MODULE --config ROLE.json``, see
    tidal.integration.launch.Role) with logs under `run_dir`, and hands back their handle."""

    def launch(self, roles: Sequence[Any], run_dir: Any) -> RunHandle: ...


__all__ = [
    "Admission",
    "AdmissionPolicy",
    "AdvantageEstimator",
    "CorrectionPolicy",
    "Engine",
    "Environment",
    "GenerationRequest",
    "GenerationResult",
    "GroupFilter",
    "Launcher",
    "MultiTurnEnvironment",
    "NamedTensors",
    "PolicyLoss",
    "RewardFn",
    "RunHandle",
    "Task",
    "Tensor",
    "TrainBackend",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
]
