"""One rank of a 2-rank FSDP2 (gloo) run: a tiny Mixtral whose MoE blocks become `MoEBlock`s, on a
("dp", "ep") mesh for each ep in argv[3:], trains STEPS AdamW steps on this rank's batches; then every
parameter is gathered with `iter_full_weights` and rank 0 saves them (and the losses) to OUT/fsdp_ep{ep}.pt.
One launch runs every mesh shape (processes are costly to start on a busy CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from moe_tiny import STEPS, batch, lm_loss, optimizer, tiny_mixtral

from tidal.core.process import exit_now
from tidal.moe_fsdp import iter_full_weights, moe_mesh, shard_moe_model


def main() -> int:
    rank, out = int(sys.argv[1]), Path(sys.argv[2])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for ep in map(int, sys.argv[3:]):
        train(rank, out, ep)
    dist.barrier()  # no rank tears gloo down while another still has work in flight (a crash at exit under load)
    dist.destroy_process_group()
    return 0


def train(rank: int, out: Path, ep: int) -> None:
    model = shard_moe_model(tiny_mixtral(), moe_mesh(ep), recompute=True)
    opt = optimizer(model)
    losses, first_grads = [], {}
    for step in range(STEPS):
        loss = lm_loss(model, batch(step, rank))
        loss.backward()
        if step == 0:  # AdamW hides a wrongly scaled gradient; compare the reduced gradients directly too
            first_grads = {name: g.clone() for name, g in iter_full_weights(model, grads=True)}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {}
    for name, full in iter_full_weights(model):
        if rank == 0:
            weights[name] = full.clone()
    if rank == 0:
        torch.save({"weights": weights, "losses": losses, "grads": first_grads}, out / f"fsdp_ep{ep}.pt")


if __name__ == "__main__":
    exit_now(main())  # no interpreter finalization: gloo's threads can abort it after the work is done
