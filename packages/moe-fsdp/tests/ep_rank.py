"""One rank of a 2-rank expert-parallel (gloo) run of `MoEBlock`: for every case in moe_tiny.EP_CASES,
forward + backward on this rank's tokens with the experts split over both ranks; saves outputs and
gradients to OUT/ep_rank{rank}.pt for the test to compare with one process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from moe_tiny import EP_CASES, block_config, block_loss, full_block, rank_inputs

from tidal.core.process import exit_now
from tidal.moe_fsdp import MoEBlock


def main() -> int:
    rank, out = int(sys.argv[1]), Path(sys.argv[2])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    results = {}
    for name, overrides, force in EP_CASES:
        cfg = block_config(**overrides)
        full = full_block(cfg)
        block = MoEBlock(cfg, ep_group=group)
        mine = slice(block.local_experts.start, block.local_experts.stop)
        with torch.no_grad():  # the router whole, this rank's slice of every expert tensor
            for pname, p in block.named_parameters():
                src = full.get_parameter(pname)
                p.copy_(src[mine] if pname.startswith("experts.") else src)
        x, g, routes = rank_inputs(rank, force)
        x.requires_grad_()
        block.force_routes(routes)
        loss, y = block_loss(block, x, g)
        loss.backward()
        results[name] = {"y": y.detach(), "x_grad": x.grad, "routes": block.routes, "local": (mine.start, mine.stop),
                         "grads": {pname: p.grad for pname, p in block.named_parameters()}}
    torch.save(results, out / f"ep_rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while another still has work in flight (a crash at exit under load)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # no interpreter finalization: gloo's threads can abort it after the work is done
