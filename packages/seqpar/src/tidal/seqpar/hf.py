"""Hugging Face transformers integration: switch a causal LM's attention to Tidal's sequence-parallel
attention (through transformers' `AttentionInterface`), and shard a batch for it; or, on one rank, to
variable-length attention over packed rows (`tidal_varlen`, see `tidal.seqpar.varlen`).

    enable_sequence_parallel(model, mesh)
    batch = shard_batch(input_ids, mesh, position_ids=pos)     # this rank's tokens, targets and layout
    logits = model(**batch.model_inputs()).logits
    loss = sp_cross_entropy(logits, batch.targets, mesh); loss.local.backward(); sum_grads(model.parameters(), mesh)

    register_varlen_attention()                 # then from_pretrained(..., attn_implementation="tidal_varlen")
    logits = model(input_ids=row, position_ids=pos, varlen_layout=VarlenLayout.from_position_ids(pos)).logits

transformers is imported only inside the functions that register (extra `tidal-seqpar[hf]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tidal.seqpar.attention import Backend, sp_attention
from tidal.seqpar.layout import ShardLayout, plan_layout, shard
from tidal.seqpar.loss import IGNORE, shift_labels
from tidal.seqpar.mesh import SPMesh
from tidal.seqpar.varlen import VarlenLayout, varlen_attention

ATTENTION_NAME = "tidal_sp"
VARLEN_ATTENTION = "tidal_varlen"


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
    # optional: the [hf] extra
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, make_attention_function(mesh, backend=backend,
                                                                        block_size=block_size))
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    set_attn_implementation = getattr(model, "set_attn_implementation", None)  # a transformers model
    if set_attn_implementation is not None:
        set_attn_implementation(ATTENTION_NAME)
    else:
        config: Any = model.config
        config._attn_implementation = ATTENTION_NAME
    return model


def _varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                      varlen_layout: VarlenLayout | None = None, position_ids: torch.Tensor | None = None,
                      **kwargs: Any):
    """`tidal_varlen`: packed rows (one row, no padding mask, no cache) go through `varlen_attention`;
    anything else (a padded batch, generation with a cache) through transformers' own SDPA."""
    packed = (query.shape[0] == 1 and attention_mask is None and query.shape[2] == key.shape[2]
              and (varlen_layout is not None or position_ids is not None))
    if not packed or sliding_window is not None or dropout:
        # optional: the [hf] extra
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if sliding_window is not None and packed:
            raise ValueError(f"tidal_varlen does not implement sliding-window attention (window "
                             f"{sliding_window}); use attn='sdpa' or 'flash_attention_2' for this model")
        if s_aux is not None:
            raise ValueError("attention sinks (s_aux) under tidal_varlen need a packed row: call the model with "
                             "position_ids (or varlen_layout) and no attention_mask")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if varlen_layout is not None:
        layout = varlen_layout
    else:
        assert position_ids is not None  # packed: one of the two is given
        layout = VarlenLayout.from_position_ids(position_ids)
    out = varlen_attention(query, key, value, layout, scale=scaling, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def _varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No [L, L] mask for a packed row (the layout is the mask); a padding mask still gets SDPA's."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask  # optional: the [hf] extra

    return sdpa_mask(*args, **kwargs)


def register_varlen_attention() -> str:
    """Register `tidal_varlen` with transformers (idempotent); returns its name, for `attn_implementation`."""
    # optional: the [hf] extra
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION
