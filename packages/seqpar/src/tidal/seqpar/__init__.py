"""Sequence parallelism for long-sequence training: Ulysses all-to-all attention, zigzag ring attention,
their 2-D hybrid, attention sinks and packed sequences, plus a Hugging Face integration (`tidal.seqpar.hf`).

    mesh = make_mesh(ulysses=2, ring=2)                   # after dist.init_process_group
    layout = plan_layout(seq_len, mesh, position_ids=pos)  # padding, zigzag, packed-sequence segments
    q, k, v = (shard(x, layout, mesh, dim=2) for x in (q, k, v))
    out = sp_attention(q, k, v, layout, mesh, sinks=sinks)
"""

from tidal.seqpar.attention import check_heads, sp_attention
from tidal.seqpar.layout import ShardLayout, plan_layout, segments_from_position_ids, shard, unshard
from tidal.seqpar.loss import sp_cross_entropy, sum_grads
from tidal.seqpar.mesh import SPMesh, make_mesh
from tidal.seqpar.ring import ring_attention

__all__ = [
    "SPMesh",
    "ShardLayout",
    "check_heads",
    "make_mesh",
    "plan_layout",
    "ring_attention",
    "segments_from_position_ids",
    "shard",
    "sp_attention",
    "sp_cross_entropy",
    "sum_grads",
    "unshard",
]
