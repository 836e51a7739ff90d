"""Helpers for tests of Tidal and of plugins: one valid instance of every wire message."""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import numpy as np

from tidal.core.arrays import Array
from tidal.core.protocol import (
    ACK_TRAJECTORY,
    PROTOCOL_VERSION,
    Ack,
    Assignment,
    Batch,
    BatchRequest,
    ChatMessage,
    Control,
    EpisodeClose,
    EpisodeOpen,
    EpisodeReply,
    EpisodeStep,
    Error,
    Heartbeat,
    Hello,
    Message,
    Metrics,
    SamplingParams,
    TensorSpec,
    ToolSpec,
    Trajectory,
    TrajectoryGroup,
    WeightsAvailable,
    WeightsBucket,
    WeightsRequest,
    WorkRequest,
    trajectory_id,
)


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM `proc` if it still runs, SIGKILL after `timeout` seconds; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for services that must bind a known address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def make_trajectory(
    i: int = 0,
    *,
    prompt_len: int = 32,
    completion_len: int = 64,
    rich: bool = False,
    seed: int = 0,
    out_of_line: bool | None = None,
) -> Trajectory:
    """A trajectory with deterministic pseudo-random content; `rich` fills every optional field;
    `out_of_line=True` sends every array as its own frame."""
    rng = np.random.default_rng(seed + i)
    n = completion_len

    def A(x: np.ndarray) -> Array:
        return Array.from_numpy(x, out_of_line=out_of_line)

    extra: dict[str, Any] = {}
    if rich:
        extra = dict(
            step_rewards=A(np.array([0.5, 1.0], np.float32)),
            step_ends=A(np.array([n // 2, n], np.int32)),
            loss_mask=A(np.ones(n, np.uint8)),
            routing=A(rng.integers(0, 8, (n, 2, 2), dtype=np.uint8)),
            sampling_mask=A(rng.integers(0, 255, (n, 4), dtype=np.uint8)),
            kv_versions=A(np.full(n, 2, np.int32)),
            metadata={"answer": "42"},
        )
    return Trajectory(
        id=f"traj-{i}",
        group_id=f"group-{i // 4}",
        sample_index=i % 4,
        task="arith",
        prompt_ids=A(rng.integers(0, 32000, prompt_len, dtype=np.int32)),
        completion_ids=A(rng.integers(0, 32000, n, dtype=np.int32)),
        logprobs=A(-rng.random(n, dtype=np.float32)),
        versions=A(np.full(n, 3, np.int32)),
        reward=float(i % 2),
        finish_reason="stop",
        **extra,
    )


def make_group(group_id: str = "group-0", size: int = 4, *, source: str = "", **kw) -> TrajectoryGroup:
    """A TrajectoryGroup of `size` `make_trajectory` samples, ids ``<group_id>:<i>`` (`kw` goes to each)."""
    trajs = []
    for i in range(size):
        t = make_trajectory(i, **kw)
        t.id, t.group_id, t.sample_index, t.source, t.group_size = trajectory_id(group_id, i), group_id, i, source, size
        trajs.append(t)
    return TrajectoryGroup(id=group_id, trajectories=trajs, source=source)


def sample_messages(out_of_line: bool | None = None) -> list[Message]:
    """One instance of every message type (Trajectory twice: plain and with every optional field);
    `out_of_line=True` makes every array travel as its own frame."""
    weights = np.arange(12, dtype=np.float32)
    return [
        Hello(role="test", name="t0", protocol=PROTOCOL_VERSION, software={"tidal-core": "0"}, pid=1, host="h"),
        Error(code="protocol", detail="bad", ref="x"),
        Ack(kind=ACK_TRAJECTORY, ids=["a", "b"]),
        Heartbeat(role="rollout", name="r0", seq=7, time=1.5, version=3, status={"in_flight": 2.0}),
        Control(command="pause", reason="weights", version=4, args={"k": "v"}),
        Metrics(
            source="learner-0",
            step=3,
            time=2.0,
            scalars={"loss/policy": 0.25},
            histograms={"lag": Array.from_numpy(weights, out_of_line=out_of_line)},
        ),
        Assignment(
            group_id="g",
            prompt_ids=Array.from_numpy(np.array([1, 2, 3], np.int32), out_of_line=out_of_line),
            num_samples=4,
            task="arith",
            sampling=SamplingParams(temperature=0.7, top_p=0.9, stop_token_ids=[2], seed=5, stop=["Answer:"]),
            answer="7",
        ),
        WorkRequest(want=2, version=3, running=1),
        make_trajectory(0, out_of_line=out_of_line),
        make_trajectory(1, rich=True, out_of_line=out_of_line),
        make_group("g1", 3, source="r0", out_of_line=out_of_line),
        Batch(batch_id="b0", rank=0, world_size=2, step=1,
              trajectories=[make_trajectory(i, out_of_line=out_of_line) for i in range(3)]),
        BatchRequest(rank=1, world_size=2, version=3, max_samples=8),
        WeightsAvailable(
            version=5,
            transport="zmq",
            manifest=[TensorSpec(name="w", dtype="float32", shape=(3, 4), nbytes=48)],
            bucket_sizes=[48],
            checksums=[123],
            location="tcp://127.0.0.1:5555",
        ),
        WeightsRequest(version=5, bucket=0),
        WeightsBucket(version=5, bucket=0, data=Array.from_numpy(np.arange(48, dtype=np.uint8), out_of_line=out_of_line)),
        EpisodeOpen(episode_id="tools-0000001:0", domain="tools", prompt="12*34=?", answer="408"),
        EpisodeStep(episode_id="tools-0000001:0", seq=1, action="<calc>12*34</calc>"),
        EpisodeReply(episode_id="tools-0000001:0", seq=0,
                     messages=[ChatMessage(role="user", content="12*34=?")], max_turns=3,
                     tools=[ToolSpec(name="calculator", description="arithmetic",
                                     parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]),
        EpisodeReply(episode_id="tools-0000001:0", seq=2, done=True, outcome=1.0, reward=0.5,
                     info={"tool_calls": 1.0}),
        EpisodeClose(episode_id="tools-0000001:0"),
    ]


__all__ = ["free_endpoint", "free_port", "make_group", "make_trajectory", "sample_messages"]
