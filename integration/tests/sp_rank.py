"""One learner rank for the sequence-parallel tests: one Trainer step on a fixed batch, split by group
over the data-parallel ranks (the SP groups) (GRPO groups of
samples sharing a prompt, several sequences per packed row, several rows, half the samples drawn at
temperature 0.7 / top-k 40), under `learner.parallel` as given. Rank 0 writes the step's loss and the
full gradients, reduced as the optimizer sees them (safetensors). The loss carries an entropy bonus."""

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
from tidal.core.protocol import SamplingParams
from tidal.integration.learner.data import Sample
from tidal.integration.learner.parallel import setup_sequence_parallel
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, ParallelConfig, TrainConfig


def batch(vocab: int, groups: int = 3, g: int = 4) -> list[Sample]:
    rng = np.random.default_rng(7)
    hot = SamplingParams(temperature=0.7, top_k=40)
    out = []
    for gi in range(groups):
        prompt = rng.integers(3, vocab, rng.integers(3, 12)).astype(np.int32)
        for k in range(g):
            t = int(rng.integers(2, 24))
            out.append(Sample(id=f"{gi}-{k}", group_id=f"g{gi}", prompt=prompt,
                              completion=rng.integers(3, vocab, t).astype(np.int32),
                              logprobs=(-rng.random(t) * 3).astype(np.float32), versions=np.zeros(t, np.int32),
                              reward=float(rng.integers(0, 2)), loss_mask=rng.random(t) > 0.1,
                              sampling=hot if k % 2 else SamplingParams()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="single")
    ap.add_argument("--model", required=True)
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--sp-mode", default="ulysses")
    ap.add_argument("--loss", default="ppo")
    ap.add_argument("--micro", type=int, default=96)
    ap.add_argument("--advantage", default="grpo", help="gae: PPO with a critic (its values gathered too)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="", help="a JSON list of runs, each a dict of the options above (model and "
                                               "micro from here): one step each, in order, in this one process "
                                               "group (a launch of torch + transformers costs more than a step)")
    args = ap.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    base = {"backend": args.backend, "sp": args.sp, "sp_mode": args.sp_mode, "loss": args.loss,
            "advantage": args.advantage, "out": args.out}
    for run in json.loads(args.runs) if args.runs else [{}]:
        one_step(args.model, args.micro, **{**base, **run})
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another still has work in flight (a crash at exit under load)
        dist.destroy_process_group()


def one_step(model: str, micro: int, backend: str, sp: int, sp_mode: str, loss: str, advantage: str, out: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    be = registry.create("train_backend", backend, model, BackendConfig(value_head=advantage == "gae"))
    par = setup_sequence_parallel(ParallelConfig(sp=sp, sp_mode=sp_mode), be)
    # an entropy bonus: its gradient crosses the SP gather too, on top-k-truncated distributions
    trainer = Trainer(be, TrainConfig(micro_batch_tokens=micro, loss=PluginRef(name=loss, options={"entropy_coef": 0.05}),
                                      advantage=PluginRef(name=advantage)), sp=par)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads() -> None:  # after every reduction, before clipping and the optimizer
        for name, p in be.model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    trainer.before_update = keep_grads
    # the data-parallel split: over SP groups, not ranks (the ranks of a group share their samples)
    dp_rank, dp = (par.dp_rank, par.dp) if par is not None else (rank, dist.get_world_size() if dist.is_initialized() else 1)
    mine = [s for s in batch(be.model.config.vocab_size) if int(s.group_id[1:]) % dp == dp_rank]
    metrics = trainer.step(mine)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(grads, out)
        with open(out + ".json", "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter finalization: gloo's threads can abort it after the work is done
