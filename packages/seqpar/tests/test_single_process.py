"""Single-process behaviour: zigzag layout and its load balance, padding, packed-sequence segments,
the head-split error, the tiled kernels against the plain reference, and label shifting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference import attention as ref_attention

from tidal.seqpar import SPMesh, check_heads, plan_layout, segments_from_position_ids, sp_attention
from tidal.seqpar.kernels import block_mask
from tidal.seqpar.layout import PAD_SEGMENT
from tidal.seqpar.loss import IGNORE, shift_labels


def fake_mesh(ulysses: int, ring: int) -> SPMesh:
    """Layout planning needs only the degrees, not process groups."""
    return SPMesh(ulysses=ulysses, ring=ring, ulysses_rank=0, ring_rank=0, ulysses_group=None, ring_group=None,
                  group=None)


@pytest.mark.parametrize(("ulysses", "ring", "seq_len"), [(1, 2, 37), (2, 2, 40), (4, 1, 30), (1, 4, 64), (2, 4, 5)])
def test_every_token_is_held_by_exactly_one_rank_and_padding_is_segment_minus_one(ulysses, ring, seq_len):
    layout = plan_layout(seq_len, fake_mesh(ulysses, ring))
    multiple = ulysses * (2 * ring if ring > 1 else 1)
    assert layout.padded_len % multiple == 0 and seq_len <= layout.padded_len < seq_len + multiple
    held = torch.cat([layout.rank_indices(r, u) for r in range(ring) for u in range(ulysses)])
    assert sorted(held.tolist()) == list(range(layout.padded_len))
    assert (layout.segments[0, seq_len:] == PAD_SEGMENT).all() and (layout.segments[0, :seq_len] == 0).all()


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_zigzag_gives_every_ring_rank_the_same_causal_work(ring):
    layout = plan_layout(64 * ring, fake_mesh(1, ring), causal=True)
    work = []
    for r in range(ring):
        q = layout.ring_indices(r)
        work.append(sum(int(block_mask(layout.segments, q, layout.ring_indices(s), True).sum()) for s in range(ring)))
    assert len(set(work)) == 1, work
    contiguous = [int(((torch.arange(64 * ring)[:, None] >= torch.arange(64 * ring)[None]))[r * 64:(r + 1) * 64].sum())
                  for r in range(ring)]
    assert len(set(contiguous)) == ring  # what zigzag avoids: contiguous shards are unbalanced


def test_segments_start_where_position_ids_restart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert segments_from_position_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]


def test_heads_that_cannot_be_split_raise_an_error_naming_heads_degree_and_fix():
    with pytest.raises(ValueError) as e:
        check_heads(6, 6, 4)
    msg = str(e.value)
    assert "Ulysses degree 4" in msg and "6 query heads" in msg and "ring" in msg and "[1, 2, 3, 6]" in msg
    with pytest.raises(ValueError, match="3 KV heads"):
        check_heads(6, 3, 2)  # 2 neither divides nor is divided by 3 KV heads
    check_heads(8, 2, 4)  # fewer KV heads than the degree: replicated, no error


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("sinks", [False, True])
def test_single_rank_tiled_attention_equals_reference_with_gradients(backend, sinks):
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, s, d = 2, 6, 2, 29, 8
    q = torch.randn(b, hq, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    sink = torch.randn(hq, generator=g, requires_grad=True) if sinks else None
    pos = torch.cat([torch.arange(9), torch.arange(20)])[None].expand(b, s)
    leaves = [q, k, v] + ([sink] if sinks else [])
    w = torch.randn(b, hq, s, d, generator=g)
    layout = plan_layout(s, SPMesh.single(), batch=b, position_ids=pos)
    out = sp_attention(q, k, v, layout, SPMesh.single(), sinks=sink, backend=backend, block_size=5)
    ref = ref_attention(q, k, v, pos, causal=True, sinks=sink)
    got = torch.autograd.grad((out * w).sum(), leaves)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    assert (out - ref).abs().max() < 1e-5
    for a, r in zip(got, want, strict=True):
        assert r.abs().max() > 1e-3 and (a - r).abs().max() < 1e-5


def test_fully_masked_rows_give_zero_output_not_nan():
    from tidal.seqpar.kernels import block_forward

    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    mask = torch.zeros(1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = True
    out, lse = block_forward(q, k, k, mask, 0.5)
    assert torch.isfinite(out).all() and (out[0, :, 1:] == 0).all() and torch.isinf(lse[0, :, 1:]).all()


def test_labels_shift_within_each_packed_sequence():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    assert shift_labels(ids, pos).tolist() == [[6, 7, IGNORE, 9, IGNORE]]


def test_a_backend_that_cannot_ring_is_refused_with_the_alternative():
    layout = plan_layout(8, fake_mesh(1, 2))
    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match="backend='math'"):
        sp_attention(q, q, q, layout, fake_mesh(1, 2), backend="sdpa")
