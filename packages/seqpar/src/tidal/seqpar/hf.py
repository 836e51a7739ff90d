"""Hugging Face transformers integration: switch a causal LM's attention to Tidal's sequence-parallel
attention (through transformers' `AttentionInterface`), and shard a batch for it.

    enable_sequence_parallel(model, mesh)
    batch = shard_batch(input_ids, mesh, position_ids=pos)     # this rank's tokens, targets and layout
    logits = model(**batch.model_inputs()).logits
    loss = sp_cross_entropy(logits, batch.targets, mesh); loss.local.backward(); sum_grads(model.parameters(), mesh)

transformers is imported only inside `enable_sequence_parallel` (extra `tidal-seqpar[hf]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tidal.seqpar.attention import Backend, sp_attention
from tidal.seqpar.layout import ShardLayout, plan_layout, shard
from tidal.seqpar.loss import IGNORE, shift_labels
from tidal.seqpar.mesh import SPMesh

ATTENTION_NAME = "tidal_sp"


@dataclass(frozen=True, slots=True)
class SPBatch:
    """One rank's share of a batch: tensors are [B, padded_len / mesh.size]."""

    input_ids: torch.Tensor  # this rank's tokens (padding: pad_token_id)
    position_ids: torch.Tensor  # their positions within their own (packed) sequence, for RoPE
    targets: torch.Tensor  # next-token targets, shifted before sharding; −100 where nothing is scored
    layout: ShardLayout  # the whole batch's layout; the attention function reads it

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the model's forward (the layout travels to attention as `sp_layout`)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "sp_layout": self.layout,
                "use_cache": False}


def shard_batch(input_ids: torch.Tensor, mesh: SPMesh, *, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, pad_token_id: int = 0) -> SPBatch:
    """Shard a full [B, S] batch for this rank: pad S to the mesh's multiple, zigzag over the ring,
    slice over Ulysses. `position_ids` [B, S] marks packed sequences (each run from 0 is one sequence);
    `labels` [B, S] (−100 = not scored) default to input_ids; targets are shifted within each sequence."""
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
    layout = plan_layout(s, mesh, batch=b, position_ids=position_ids, causal=True)
    targets = shift_labels(input_ids, position_ids, labels)
    return SPBatch(input_ids=shard(input_ids, layout, mesh, pad_value=pad_token_id),
                   position_ids=shard(position_ids, layout, mesh, pad_value=0),
                   targets=shard(targets, layout, mesh, pad_value=IGNORE), layout=layout)


def make_attention_function(mesh: SPMesh, *, backend: Backend = "math", block_size: int = 512):
    """A transformers attention function (the `AttentionInterface` signature) running `sp_attention`
    on `mesh`: query [B, Hq, Sl, D], key/value [B, Hkv, Sl, D] → ([B, Sl, Hq, D], None). GPT-OSS style
    sinks arrive as `s_aux` [Hq]; the layout as `sp_layout`."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                  sp_layout: ShardLayout | None = None, **kwargs: Any):
        if sp_layout is None:
            raise ValueError("sequence-parallel attention needs the batch layout: call the model with "
                             "**shard_batch(...).model_inputs() (it passes sp_layout=...)")
        if dropout:
            raise ValueError(f"attention dropout {dropout} is not supported under sequence parallelism; "
                             "set the model's attention_dropout to 0")
        if sliding_window is not None:
            raise ValueError(f"sliding-window attention (window {sliding_window}) is not supported by "
                             "tidal.seqpar; use a model config without sliding layers")
        out = sp_attention(query, key, value, sp_layout, mesh, sinks=s_aux, scale=scaling, backend=backend,
                           block_size=block_size)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the layout carries the mask; transformers must not build a [S, S] one per rank


def enable_sequence_parallel(model: torch.nn.Module, mesh: SPMesh, *, backend: Backend = "math",
                             block_size: int = 512) -> torch.nn.Module:
    """Register Tidal's SP attention as transformers attention implementation "tidal_sp" (one mesh per
    process) and switch `model` to it. Returns the model. Call the model with `SPBatch.model_inputs()`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, make_attention_function(mesh, backend=backend,
                                                                        block_size=block_size))
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
    return model
