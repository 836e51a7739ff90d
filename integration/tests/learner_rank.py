"""One learner rank for the backend tests: a fixed synthetic batch stream, k steps, optional checkpoint
save/load, final full weights written by rank 0 (safetensors); optionally expert parallelism (`--ep`),
recorded MoE routing replayed (`--replay`), the first step's full gradients and every step's
metrics written by rank 0 (`--grads`, `--metrics`), and the trainer's own state (`--state`, every rank;
the advantage estimator's: `--advantage rae` trains on role keys "game<group // 2>/<first|second>")."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist

from tidal.core.config import PluginRef
from tidal.core.plugins import registry
from tidal.core.process import exit_now
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner.checkpoint import load_checkpoint, save_checkpoint
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig


def batch(step: int, vocab: int, groups: int = 4, g: int = 4, routing: tuple[int, int] | None = None
          ) -> list[Sample]:
    """`routing` (moe layers, experts): each sample carries recorded top-2 routes (two distinct experts)."""
    rng = np.random.default_rng(1000 + step)
    out = []
    for gi in range(groups):
        prompt = rng.integers(3, vocab, rng.integers(3, 10)).astype(np.int32)
        for k in range(g):
            t = int(rng.integers(2, 20))
            routes = None
            if routing is not None:
                layers, experts = routing
                first = rng.integers(0, experts, (t, layers))
                routes = np.stack([first, (first + rng.integers(1, experts, (t, layers))) % experts], -1)
            out.append(Sample(id=f"{step}-{gi}-{k}", group_id=f"{step}-{gi}", prompt=prompt,
                              completion=rng.integers(3, vocab, t).astype(np.int32),
                              logprobs=(-rng.random(t) * 3).astype(np.float32), versions=np.zeros(t, np.int32),
                              reward=float(rng.integers(0, 2)), loss_mask=np.ones(t, bool),
                              routing=None if routes is None else routes.astype(np.int16),
                              role_key=f"game{gi // 2}/{('first', 'second')[k % 2]}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="single")
    ap.add_argument("--model", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--load", default="")
    ap.add_argument("--save", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--loss", default="ppo")
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--die-after-save", action="store_true", help="SIGKILL this rank once the checkpoint is written")
    ap.add_argument("--correction", default="")
    ap.add_argument("--groups", default="4", help="groups per batch (fewer than ranks leaves some empty); a "
                    "comma-separated list: step k has the (k mod length)-th")
    ap.add_argument("--advantage", default="grpo")
    ap.add_argument("--state", default="", help="every rank writes the trainer's state_dict here (JSON; <state>.rank<k>)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (fsdp2)")
    ap.add_argument("--replay", action="store_true", help="samples carry MoE routing; the learner replays it")
    ap.add_argument("--grads", default="", help="rank 0 writes the first step's full gradients here")
    ap.add_argument("--metrics", default="", help="rank 0 writes every step's metrics here (JSON lines)")
    ap.add_argument("--every-rank", action="store_true", help="ranks > 0 write their weights too (<out>.rank<k>)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA of this rank (learner.lora); the adapters are written")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    cfg = BackendConfig(optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=10))
    if args.backend.startswith("deepspeed"):  # deepspeed2 / deepspeed3: the ZeRO stage
        be = registry.create("train_backend", "deepspeed", args.model, cfg, zero_stage=int(args.backend[-1]))
    else:
        extra = {"ep": args.ep} if args.ep > 1 else {}
        if args.lora:
            from tidal.learner.config import LoraOptions

            extra["lora"] = LoraOptions(rank=args.lora, alpha=2.0 * args.lora)
        be = registry.create("train_backend", args.backend, args.model, cfg, **extra)
    trainer = Trainer(be, TrainConfig(micro_batch_tokens=args.micro, loss=PluginRef(name=args.loss),
                                      advantage=PluginRef(name=args.advantage),
                                      correction=PluginRef(name=args.correction) if args.correction else None),
                      routing_replay=args.replay)
    grads: dict[str, torch.Tensor] = {}
    if args.grads:  # after the first step's backward, before the optimizer: the reduced full gradients
        from tidal.moe_fsdp import iter_full_weights

        def keep_grads() -> None:
            if not grads:
                grads.update((n, g.clone()) for n, g in iter_full_weights(be.model, grads=True))

        trainer.before_update = keep_grads
    routing = None
    if args.replay:
        from tidal.moe_fsdp import moe_blocks

        routing = (be.moe_layers, moe_blocks(be.model)[0].config.num_experts)
    step = args.start
    if args.load:
        step = load_checkpoint(args.load, be)["step"]
    vocab = be._module().config.vocab_size
    for _ in range(args.steps):
        groups = [int(g) for g in args.groups.split(",")]
        samples = batch(step, vocab, groups=groups[step % len(groups)], routing=routing)
        mine = [s for s in samples if int(s.group_id.split("-")[1]) % world == rank]
        metrics = trainer.step(mine)
        step += 1
        if rank == 0:
            print(f"step {step} loss {metrics['loss/total']:.6f} grad_norm {metrics['train/grad_norm']:.6f}", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
    if args.save:
        save_checkpoint(args.save, be, {"step": step, "version": step})
        if args.die_after_save:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
    if args.state:
        with open(args.state if rank == 0 else f"{args.state}.rank{rank}", "w") as f:
            json.dump(trainer.state_dict(), f)
    state = {n: t.contiguous().clone() for n, t in be.named_weights()}
    if rank == 0 or args.every_rank:
        from safetensors.torch import save_file

        save_file(state, args.out if rank == 0 else f"{args.out}.rank{rank}")
        if args.grads and rank == 0:
            save_file(grads, args.grads)
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another still has work in flight (CI saw 'terminate called without an active exception' from deepspeed3's rank 1)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter finalization: gloo's threads can abort it after the work is done
