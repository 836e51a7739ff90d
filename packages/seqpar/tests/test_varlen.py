"""Variable-length attention over packed rows: equal to each sequence attended alone (forward and
gradients, grouped heads, sinks), and its cost follows Σ len², not the row's length squared."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference import attention as ref_attention

from tidal.seqpar.varlen import VarlenLayout, varlen_attention

LENGTHS = [13, 9, 17, 5, 13, 1, 40]


def _qkv(lengths, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(1, h, n, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("sinks", [False, True])
def test_packed_row_equals_each_sequence_alone_with_gradients(sinks):
    q, k, v = _qkv(LENGTHS)
    s = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    layout = VarlenLayout.from_position_ids(pos, fill=0.5)
    assert len(layout.buckets) > 1  # several buckets, padding inside them: the hard case
    out = varlen_attention(q, k, v, layout, scale=0.3, sinks=s)
    ref = ref_attention(q, k, v, pos, causal=True, sinks=s, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, *([s] if sinks else [])], dout)
    want = torch.autograd.grad(ref, [q, k, v, *([s] if sinks else [])], dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cost_follows_the_sum_of_squared_lengths_not_the_row():
    lengths = [60] * 40  # a 2,400-token row of forty 60-token sequences
    layout = VarlenLayout.from_lengths(lengths)
    assert layout.cost == sum(n * (n + 1) // 2 for n in lengths)
    assert layout.dense_cost > 35 * layout.cost
    tail = [4, 64, 7, 33, 50, 12, 64, 9]  # long tail: padding inside buckets stays bounded by fill
    lay = VarlenLayout.from_lengths(tail, fill=0.75)
    assert lay.cost <= sum(n * (n + 1) // 2 for n in tail) / 0.75**2


def test_bad_layouts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="start at 0"):
        VarlenLayout.from_position_ids(torch.tensor([[1, 2, 0, 1]]))
    q, k, v = _qkv([3, 4])
    with pytest.raises(ValueError, match="row of 5 tokens"):
        varlen_attention(q, k, v, VarlenLayout.from_lengths([2, 3]))


def test_hf_model_on_tidal_varlen_matches_sdpa_on_each_sequence_alone():
    transformers = pytest.importorskip("transformers")  # the [hf] extra
    from tidal.seqpar.hf import register_varlen_attention

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, sum(LENGTHS)))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    model.set_attn_implementation("sdpa")
    alone = torch.cat([model(input_ids=part, use_cache=False).logits
                       for part in ids.split(LENGTHS, dim=1)], 1)
    model.set_attn_implementation(register_varlen_attention())
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # a padded batch (attention mask) still works: it goes through SDPA
    batch = model(input_ids=ids[:, :10].repeat(2, 1), attention_mask=torch.ones(2, 10, dtype=torch.long)).logits
    torch.testing.assert_close(batch[0], alone[0, :10], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_shared_prefix_attends_like_prefix_plus_completion_packed_alone(sinks):
    """Row = [prompt A (5), a1 (3), a2 (1), a3 (6), prompt B (2), b1 (4), plain sequence (7)]: each
    completion's outputs (and gradients) equal those of its prompt + itself attended alone."""
    from tidal.seqpar.varlen import Item

    q, k, v = _qkv([5, 3, 1, 6, 2, 4, 7], seed=1)
    s = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    items = [Item(0, 5), Item(5, 3, 0, 5), Item(8, 1, 0, 5), Item(9, 6, 0, 5), Item(15, 2), Item(17, 4, 15, 2),
             Item(21, 7)]
    out = varlen_attention(q, k, v, VarlenLayout.from_items(items, fill=0.5), scale=0.3, sinks=s)
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum(), [q, k, v])
    # reference: every (prefix + own) sequence attended alone, scattered back; the prefix tokens once
    ref = torch.zeros_like(out)
    for it in items:
        idx = torch.cat([torch.arange(it.prefix_start, it.prefix_start + it.prefix),
                         torch.arange(it.start, it.start + it.length)])
        pos = torch.arange(len(idx))[None]
        o = ref_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], pos, causal=True, sinks=s, scale=0.3)
        ref[:, :, it.start : it.start + it.length] = o[:, :, it.prefix :]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    want = torch.autograd.grad((ref * dout).sum(), [q, k, v])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="exactly once"):
        VarlenLayout.from_items([Item(0, 5), Item(3, 4)])
