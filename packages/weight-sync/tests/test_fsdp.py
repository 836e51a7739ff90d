"""A model sharded with FSDP2 over 2 gloo ranks sends its full weights, gathered one tensor at a time,
and they load into an unsharded copy bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from tidal.core.protocol import WeightsAvailable
from tidal.core.testing import free_port
from tidal.weight_sync import WeightReceiver, load_into

HERE = Path(__file__).parent


@pytest.mark.timeout(300)
def test_fsdp2_sharded_model_loads_into_an_unsharded_copy(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(HERE / "fsdp_rank.py"), str(r), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ann = msgspec.json.decode((tmp_path / "announcement.json").read_bytes(), type=WeightsAvailable)
    expected = load_file(str(tmp_path / "expected.safetensors"))
    unsharded = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 17))
    with WeightReceiver("fs") as receiver:
        receiver.receive(ann, load_into(unsharded))
    got = unsharded.state_dict()
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert len(ann.bucket_sizes) > 1  # packed into several buckets as the tensors were gathered
