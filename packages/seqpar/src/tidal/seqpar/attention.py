"""Sequence-parallel attention: Ulysses, ring, or both on a 2-D mesh — one entry point, `sp_attention`.

Each rank holds a slice of the sequence (`layout.rank_indices`). The Ulysses all-to-all trades the
sequence split inside the Ulysses group for a head split; attention then runs over the ring rank's whole
zigzag pair, rotating K/V over the ring group when ring > 1; a second all-to-all restores the sequence split.
"""

from __future__ import annotations

from typing import Literal

import torch

from tidal.seqpar.collectives import heads_to_seq, seq_to_heads
from tidal.seqpar.layout import ShardLayout
from tidal.seqpar.local import flash_attention, sdpa_attention
from tidal.seqpar.mesh import SPMesh
from tidal.seqpar.ring import ring_attention

Backend = Literal["math", "sdpa", "flash"]


def check_heads(q_heads: int, kv_heads: int, ulysses: int) -> None:
    """Raise ValueError, naming the numbers and the fix, when `ulysses` cannot split the heads: the query
    heads must be a multiple of the degree, and the KV heads a multiple or a divisor of it."""
    fits = [u for u in range(1, q_heads + 1) if q_heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if ulysses not in fits:
        raise ValueError(
            f"Ulysses degree {ulysses} cannot split {q_heads} query heads / {kv_heads} KV heads: the degree must "
            f"divide the query heads, and the KV heads must be a multiple or a divisor of it. Use a Ulysses degree "
            f"in {fits} and put the rest of the sequence parallelism on the ring "
            f"(e.g. make_mesh(ulysses={max(u for u in fits if u <= ulysses)}, ring=...)).")


def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout, mesh: SPMesh, *,
                 sinks: torch.Tensor | None = None, scale: float | None = None, backend: Backend = "math",
                 block_size: int = 512) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, differentiable in q, k, v and sinks.

    q [B, Hq, Sl, D], k/v [B, Hkv, Sl, D] hold this rank's tokens, Sl = layout.padded_len / mesh.size;
    sinks [Hq] optional per-head sink logits (the full, replicated parameter); returns [B, Hq, Sl, D].
    `backend`: "math" (tiled torch, any mesh, sinks), "sdpa" (torch SDPA, ring = 1), "flash" (flash-attn,
    ring = 1, CUDA, no sinks). Parameter gradients are this rank's share: sum them over `mesh.group`.
    """
    if (layout.ring, layout.ulysses) != (mesh.ring, mesh.ulysses):
        raise ValueError(f"layout was planned for ulysses={layout.ulysses} x ring={layout.ring}, the mesh is "
                         f"ulysses={mesh.ulysses} x ring={mesh.ring}; plan_layout with this mesh")
    expected = layout.padded_len // mesh.size
    if q.shape[2] != expected or k.shape[2] != expected:
        raise ValueError(f"this rank should hold {expected} tokens (padded {layout.padded_len} / {mesh.size} ranks), "
                         f"got q {q.shape[2]}, k {k.shape[2]}: shard inputs with tidal.seqpar.shard")
    hq, hkv, u = q.shape[1], k.shape[1], mesh.ulysses
    check_heads(hq, hkv, u)
    if backend != "math" and mesh.ring > 1:
        raise ValueError(f"backend={backend!r} runs whole-sequence attention; with ring={mesh.ring} use backend='math'")
    if backend == "flash" and sinks is not None:
        raise ValueError("flash-attn has no attention sinks; use backend='sdpa' or 'math' for a model with sinks")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if hkv < u:  # replicate each KV head just enough that every Ulysses rank gets one
        k, v = k.repeat_interleave(u // hkv, 1), v.repeat_interleave(u // hkv, 1)
    q, k, v = (seq_to_heads(x, mesh.ulysses_group, u) for x in (q, k, v))
    if sinks is not None:
        n = hq // u
        sinks = sinks[mesh.ulysses_rank * n:(mesh.ulysses_rank + 1) * n]
    if backend == "math":
        out = ring_attention(q, k, v, layout, group=mesh.ring_group, rank=mesh.ring_rank, size=mesh.ring,
                             sinks=sinks, scale=scale, block_size=block_size)
    elif backend == "sdpa":
        out = sdpa_attention(q, k, v, layout.segments, causal=layout.causal, scale=scale, sinks=sinks)
    elif backend == "flash":
        out = flash_attention(q, k, v, layout.segments, causal=layout.causal, scale=scale)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'math', 'sdpa' or 'flash'")
    return heads_to_seq(out, mesh.ulysses_group, u)
