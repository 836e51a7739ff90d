"""One rank of a 2-rank FSDP2 (gloo) job: shards a small model, takes an optimizer step, and sends the
full weights through the fs transport from rank 0, gathering one tensor at a time. Rank 0 also writes
the expected full state (gathered separately) and the announcement for the test to check."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tidal.core.process import exit_now
from tidal.weight_sync import WeightSender
from tidal.weight_sync.fsdp import sync_from_sharded


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 17))


def main() -> int:
    rank, out = int(sys.argv[1]), Path(sys.argv[2])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = build()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model(torch.randn(4, 33)).pow(2).mean().backward()
    opt.step()
    expected = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}
    sender = WeightSender("fs", root=str(out / "weights"), bucket_bytes=4096) if rank == 0 else None
    ann = sync_from_sharded(sender, model, version=1)
    if rank == 0:
        save_file(expected, str(out / "expected.safetensors"))
        (out / "announcement.json").write_bytes(msgspec.json.encode(ann))
    dist.barrier()  # no rank tears gloo down while another still has work in flight (a crash at exit under load)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # no interpreter finalization: gloo's threads can abort it after the work is done
