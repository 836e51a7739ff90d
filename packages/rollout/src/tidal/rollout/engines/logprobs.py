"""Teacher-forced logprobs: what a plain forward pass says about tokens an engine sampled.

The check that everything downstream relies on: for a sampled completion, the engine's per-token
logprobs must equal these, computed by an ordinary full-sequence forward of the same weights under the
same processing (temperature, top-k, top-p). The learner uses the same function to recompute
logprobs with the processing the sampler applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tidal.core.protocol import SamplingParams
from tidal.rollout.engines.sampling import process_logits


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                            sampling: SamplingParams | None = None, *, fp32_lm_head: bool = False) -> torch.Tensor:
    """Processed logprob of each completion token [T] (fp32) under `model`, one forward over prompt +
    completion. `model` is any transformers causal LM (sdpa or eager attention)."""
    sampling = sampling or SamplingParams()
    lm: Any = model  # a transformers causal LM: its decoder (`.model`) and head are per architecture
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=lm.device)
    hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    p = len(prompt_ids)
    h = hidden[p - 1 : p - 1 + len(completion_ids)]
    head = lm.get_output_embeddings()
    if fp32_lm_head:
        logits = F.linear(h.float(), head.weight.float(), None if head.bias is None else head.bias.float())
    else:
        logits = head(h)
    logp = process_logits(logits, [sampling] * len(completion_ids))
    return logp.gather(1, torch.tensor(completion_ids, device=logp.device)[:, None])[:, 0]
