"""One rank of the multi-process tests: runs every case for the meshes of its world size against the
single-process references and rank 0 writes the max abs differences as JSON.

    python sp_worker.py RANK WORLD PORT OUT.json
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from reference import attention as ref_attention

from tidal.core.process import exit_now
from tidal.seqpar import make_mesh, plan_layout, shard, sp_attention, sp_cross_entropy, sum_grads, unshard

DEVICE = os.environ.get("TIDAL_SP_DEVICE", "cpu")  # "cuda" with NCCL: tools/gpu/seqpar_check.sh
MESHES = {2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4), (2, 2)]}
HEADS = {"mha": (4, 4), "gqa": (8, 2)}


def packed_positions(b: int, lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None].expand(b, -1).contiguous()


def attention_case(mesh, *, causal: bool, sinks: bool, packed: bool, heads: str, backend: str, seed: int) -> dict:
    hq, hkv = HEADS[heads]
    b, s, d = 2, 37, 8  # 37 is divisible by no mesh: padding is always exercised
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(b, hkv, s, d, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(b, hkv, s, d, generator=g).to(DEVICE).requires_grad_()
    sink = (torch.randn(hq, generator=g) * 2).to(DEVICE).requires_grad_() if sinks else None
    pos = (packed_positions(b, [11, 15, 11]) if packed else torch.arange(s)[None].expand(b, s)).to(DEVICE)
    weight = torch.randn(b, hq, s, d, generator=g).to(DEVICE)  # a fixed random cotangent
    leaves = [q, k, v] + ([sink] if sinks else [])

    ref = ref_attention(q, k, v, pos, causal=causal, sinks=sink)
    ref_grads = torch.autograd.grad((ref * weight).sum(), leaves)

    layout = plan_layout(s, mesh, batch=b, position_ids=pos, causal=causal)
    local = [shard(x, layout, mesh, dim=2) for x in (q, k, v)]
    out = sp_attention(*local, layout, mesh, sinks=sink, backend=backend)
    loss = (out * shard(weight, layout, mesh, dim=2)).sum()
    grads = [gr.contiguous() for gr in torch.autograd.grad(loss, leaves)]  # gloo reduces contiguous memory
    for gr in grads:
        dist.all_reduce(gr, group=mesh.group)  # each rank holds its tokens' share
    full = unshard(out.detach(), layout, mesh, dim=2)
    return {"out": (full - ref).abs().max().item(),
            "grad": max((a - r).abs().max().item() for a, r in zip(grads, ref_grads, strict=True)),
            "padded": layout.padded_len, "ref_scale": max(r.abs().max().item() for r in ref_grads)}


def tiny_qwen(hkv: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=hkv, max_position_embeddings=128,
                      attn_implementation="eager")
    return Qwen2ForCausalLM(cfg).float().to(DEVICE)


def hf_case(mesh, *, hkv: int, backend: str, packed: bool) -> dict:
    from tidal.seqpar.hf import enable_sequence_parallel, shard_batch

    lengths = [13, 9, 15] if packed else [37]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=g).to(DEVICE)
    pos = packed_positions(1, lengths).to(DEVICE)

    ref_model = tiny_qwen(hkv)
    total, count, start = 0.0, 0, 0
    for n in lengths:  # the unsplit model, one sequence at a time: nothing can leak across boundaries
        seq = ids[:, start:start + n]
        logits = ref_model(input_ids=seq).logits
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1].float(), seq[0, 1:], reduction="sum")
        count += n - 1
        start += n
    ref_loss = total / count
    ref_loss.backward()

    model = enable_sequence_parallel(copy.deepcopy(tiny_qwen(hkv)), mesh, backend=backend)
    model.zero_grad()
    batch = shard_batch(ids, mesh, position_ids=pos)
    loss = sp_cross_entropy(model(**batch.model_inputs()).logits, batch.targets, mesh)
    loss.local.backward()
    sum_grads(model.parameters(), mesh)
    ref_params = dict(ref_model.named_parameters())
    grad = max((p.grad - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {"loss": abs(loss.value.item() - ref_loss.item()), "grad": grad, "tokens": loss.tokens,
            "ref_tokens": count, "ref_scale": max(p.grad.abs().max().item() for p in ref_model.parameters())}


def cases(world: int) -> list[tuple[str, tuple[int, int], str, dict]]:
    """Every case run with `world` processes: (key, (ulysses, ring), kind, arguments)."""
    out = []
    for u, r in MESHES[world]:
        for i, (backend, causal, sinks, packed, heads) in enumerate(
                itertools.product(("math", "sdpa") if r == 1 else ("math",), (True, False), (False, True),
                                  (False, True), HEADS)):
            if backend == "sdpa" and world == 4 and not (packed and heads == "gqa"):
                continue  # the sdpa kernel is covered fully with 2 processes; keep the 4-process run short
            if world == 4 and not causal and (u, r) != (2, 2):
                continue  # non-causal with 4 ranks: on the hybrid mesh only (every mesh has it with 2)
            key = (f"u{u}r{r}/{backend}/{'causal' if causal else 'full'}/{'sinks' if sinks else 'nosinks'}/"
                   f"{'packed' if packed else 'single'}/{heads}")
            out.append((key, (u, r), "attn", dict(causal=causal, sinks=sinks, packed=packed, heads=heads,
                                                  backend=backend, seed=i)))
        hf = [(2, "math", True), (1, "math", False)] + ([(2, "sdpa", True)] if r == 1 else [])
        for hkv, backend, packed in hf:
            key = f"u{u}r{r}/{backend}/kv{hkv}/{'packed' if packed else 'single'}"
            out.append((key, (u, r), "hf", dict(hkv=hkv, backend=backend, packed=packed)))
    return out


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank, world_size=world)
    results: dict[str, dict] = {}
    meshes = {}
    for key, dims, kind, kwargs in cases(world):
        if dims not in meshes:
            meshes[dims] = make_mesh(ulysses=dims[0], ring=dims[1])
        run = attention_case if kind == "attn" else hf_case
        results[f"{kind}/{key}"] = run(meshes[dims], **kwargs)
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter finalization: gloo's threads can abort it after the work is done
