"""The learner's seams with a toy model of their own (no Tidal backend, no buffer): a recorded run replayed
through `loop.run`, a checkpoint resumed without training a batch twice, a recording cut by a crash, the
background checkpoint's acknowledgements, and a source that does not exist."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal.core.arrays import Array
from tidal.core.config import PluginRef
from tidal.core.errors import ConfigError
from tidal.core.protocol import Batch, Trajectory
from tidal.core.testing import free_endpoint
from tidal.learner import loop
from tidal.learner.checkpoint import Checkpointer
from tidal.learner.config import LearnerConfig, WeightsConfig
from tidal.learner.learner import Learner
from tidal.learner.sources import BatchRecorder, read_recording, recording_file

VOCAB, GOOD = 8, 3


def _sample(i: int, token: int) -> Trajectory:
    def arr(x: list, dt: type) -> Array:
        return Array.from_numpy(np.asarray(x, dt))

    return Trajectory(id=f"s{i}", group_id=f"g{i // 4}", sample_index=i % 4, task="toy",
                      prompt_ids=arr([1], np.int32), completion_ids=arr([token], np.int32),
                      logprobs=arr([-2.0], np.float32), versions=arr([0], np.int32),
                      reward=float(token == GOOD), finish_reason="stop")


def _batch(b: int) -> Batch:
    return Batch(batch_id=f"b{b}", rank=0, world_size=1,
                 trajectories=[_sample(4 * b + k, GOOD if k % 2 else 5) for k in range(4)])


def _record(folder: Path, ids: list[int]) -> None:
    rec = BatchRecorder(folder, dp_rank=0)
    for b in ids:
        rec.write(_batch(b))
    rec.close()


class Toy:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.05)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])

    def named_weights(self):
        yield from self.model.state_dict().items()


class Reinforce:
    def __init__(self, backend: Toy) -> None:
        self.backend, self.before_update, self.seen, self.versions = backend, None, [], []

    def at_version(self, version: int) -> None:  # optional: the loop says the version each step trains from
        self.versions.append(version)

    def step(self, work: tuple[str, list[Trajectory]]) -> dict[str, float]:
        batch_id, trajectories = work
        self.seen.append(batch_id)
        rewards = torch.tensor([t.reward for t in trajectories])
        tokens = torch.tensor([int(t.completion_ids.numpy()[0]) for t in trajectories])
        logp = torch.log_softmax(self.backend.model(torch.ones(len(tokens), dtype=torch.long)), -1)
        loss = -((rewards - rewards.mean()) * logp.gather(1, tokens[:, None])[:, 0]).mean()
        self.backend.optim.zero_grad()
        loss.backward()
        self.backend.optim.step()
        return {"loss/total": float(loss.detach()), "train/sequences": float(len(tokens)), "train/tokens": float(len(tokens))}


def _learner(tmp_path: Path, **cfg) -> tuple[Learner, Reinforce]:
    backend = Toy()
    trainer = Reinforce(backend)
    config = LearnerConfig(source=PluginRef(name="replay", options={"path": str(tmp_path / "rec")}),
                           publish=free_endpoint(), weights=WeightsConfig(every=0),
                           checkpoint_dir=str(tmp_path / "ckpt"), **cfg)
    return Learner(config, backend, trainer, prepare=lambda batch, full: (batch.batch_id, batch.trajectories)), trainer


def test_a_replay_resumed_from_its_checkpoint_trains_each_recorded_batch_once(tmp_path):
    # b1 recorded twice: the recording learner was killed between checkpoints and served it again
    _record(tmp_path / "rec", [0, 1, 1, 2, 3])
    first, t1 = _learner(tmp_path, max_steps=2, checkpoint_every=1)
    assert loop.run(first) == 0
    assert t1.seen == ["b0", "b1"] and first.version == 2

    again, t2 = _learner(tmp_path, checkpoint_every=1)
    assert again.version == 2  # from the checkpoint
    assert loop.run(again) == 0  # the recording ends: the learner stops as if asked to
    assert t2.seen == ["b2", "b3"] and again.version == 4
    assert t1.versions == [0, 1] and t2.versions == [2, 3]  # resumed: the versions go on from the checkpoint
    assert again.checkpointer.load() == {"step": 4, "version": 4, "trained": ["b0", "b1", "b2", "b3"],
                                         "samples_trained": 16}


def test_a_recording_cut_by_a_crash_replays_its_whole_batches(tmp_path, caplog):
    _record(tmp_path / "rec", [0, 1, 2])
    path = recording_file(tmp_path / "rec", 0)
    path.write_bytes(path.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING, logger="tidal.learner"):
        assert [b.batch_id for b in read_recording(path)] == ["b0", "b1"]
    assert "cut short" in caplog.text


def test_a_source_that_is_not_there_is_refused_naming_the_sources(tmp_path):
    with pytest.raises(ConfigError, match=r"no recording .*batches-0\.msgpack.*record_batches"):
        _learner(tmp_path)
    config = LearnerConfig(source=PluginRef(name="kafka"), publish=free_endpoint())
    with pytest.raises(ConfigError, match=r"no batch source 'kafka'.*\"replay\""):
        Learner(config, Toy(), Reinforce(Toy()), prepare=lambda batch, full: batch)


def test_a_background_checkpoint_releases_its_batches_once_written(tmp_path):
    backend = Toy()
    with ThreadPoolExecutor(max_workers=1) as pool:
        ckpt = Checkpointer(tmp_path / "ckpt", backend, every=2, keep=2, background=pool)
        assert ckpt.due(2) and not ckpt.due(3)
        assert ckpt.save({"step": 2, "version": 2}, ["b0", "b1"], background=True) == []
        assert ckpt.collect(wait=True) == ["b0", "b1"]  # written: acknowledgeable now, once
        assert ckpt.collect(wait=True) == []
        # a foreground checkpoint releases its own batches and any a background one still held
        ckpt.save({"step": 4, "version": 4}, ["b2"], background=True)
        assert ckpt.save({"step": 6, "version": 6}, ["b3"]) == ["b2", "b3"]
    assert ckpt.load() == {"step": 6, "version": 6}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-000004", "step-000006"]
