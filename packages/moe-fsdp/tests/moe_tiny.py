"""Shared by the tests and the rank scripts: the tiny models, their data and the training step, so the
distributed run and the single-process reference cannot drift apart."""

from __future__ import annotations

import torch

from tidal.moe_fsdp import MoEBlock, MoEConfig, moe_blocks

EP_CASES = [  # (name, config overrides, force routes): each exercised on 2 EP ranks against one process
    ("softmax-norm", {"score": "softmax", "normalize": True}, False),
    ("softmax-norm-recompute", {"score": "softmax", "normalize": True, "recompute": True}, False),
    ("sigmoid-raw", {"score": "sigmoid", "normalize": False}, False),
    ("replay-skewed", {"score": "softmax", "normalize": True, "recompute": True}, True),
    ("gpt-oss", {"layout": "gpt_oss"}, False),
    ("gpt-oss-replay-recompute", {"layout": "gpt_oss", "recompute": True}, True),
]
TOKENS = (7, 11)  # tokens on rank 0 and rank 1: uneven, so the all-to-all splits are uneven


def block_config(**overrides) -> MoEConfig:
    return MoEConfig(**{"hidden_size": 8, "intermediate_size": 12, "num_experts": 4, "top_k": 2, **overrides})


def full_block(cfg: MoEConfig) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(cfg)
    with torch.no_grad():  # GPT-OSS: biases start at 0; make them matter, and the clamps bite
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
        if cfg.layout == "gpt_oss":
            block.experts.gate_up_proj.mul_(8.0)
    return block


def rank_inputs(rank: int, force: bool):
    """x [T_r, H], the upstream gradient g [T_r, H], and forced routes [T_r, k] or None."""
    gen = torch.Generator().manual_seed(100 + rank)
    t = TOKENS[rank]
    x = torch.randn(t, 8, generator=gen)
    g = torch.randn(t, 8, generator=gen)
    routes = None
    if force:  # everything onto experts 0 and 1 (rank 0's), nothing to expert 3: empty and one-way splits
        routes = torch.stack([torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.long)], dim=1)
        routes[::3, 1] = 2
    return x, g, routes


def block_loss(block: MoEBlock, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    y = block(x)
    if isinstance(y, tuple):  # layout gpt_oss: (output, router scores)
        y = y[0]
    return (y * g).sum() + 0.1 * block.aux_loss + 0.01 * block.z_loss, y


# ---------------------------------------------------------------- the tiny Mixtral and its training

STEPS = 3
LR = 1e-2


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, router_jitter_noise=0.0, tie_word_embeddings=False,
                        rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).float()


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 48, (2, 9), generator=gen)


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    for block in moe_blocks(model):
        loss = loss + 0.01 * block.aux_loss + 1e-3 * block.z_loss
    return loss


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


# ---------------------------------------------------------------- launching 2 gloo ranks


def run_ranks(script, *args: str, world: int = 2, timeout: float = 200.0) -> None:
    """Run `script RANK ARGS...` as `world` processes on one free port; every process is stopped
    before this returns, and a failing rank's output is in the assertion message."""
    import os
    import subprocess
    import sys

    from tidal.core.testing import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {r} of {script} failed:\n{out}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
