"""One step of the embedded engine as a packed row: what each running sequence feeds (decoding ones
their last token, first; prefilling ones all their pending tokens), where the keys/values go, and the
packed position each sequence samples its next token from. A follower (a fresh sequence with the same
tokens as an earlier one in the step: a group's shared prompt) feeds nothing and samples from its
leader's position."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tidal.core.interfaces import GenerationRequest
from tidal.rollout.engines.attention import _KVCache, _StepLayout, group_fresh_spans

# --------------------------------------------------------------------------- sequences


@dataclass(eq=False)  # identity: the engine finds sequences in lists, and field equality is O(tokens)
class _Seq:
    req: GenerationRequest
    seed: int  # sampling seed (the noise of token t is a hash of seed and t)
    tokens: list[int]  # prompt + completion so far
    prompt_len: int
    computed: int = 0  # tokens whose keys/values are in the cache
    row: int = -1  # cache row while running
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # the version whose weights (re)built this sequence's KV cache from its first token: set when it is fed
    # from position 0 (joined, recompute, retry) and kept across updates in "continue" mode, where the old
    # keys/values stay; every token sampled attends to them, so it is each token's oldest KV version
    kv_floor: int = -1
    kv_versions: list[int] = field(default_factory=list)  # kv_floor of each sampled token
    masks: list[np.ndarray] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    stop_window: int = 0  # trailing tokens decoded to look for the request's stop strings; 0 = it has none

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class PackedStep:
    ids: list[int]  # the packed row's token ids
    layout: _StepLayout  # where each packed token goes (read by the attention through `_ctx.step`)
    last: list[int]  # per sequence: the packed position whose logits it samples from
    fed: list[tuple[int, int]]  # per sequence: the packed range of the tokens it fed


def pack_step(batch: list[_Seq], shared: dict[int, int], cache: _KVCache, device: torch.device) -> PackedStep:
    """The packed row of `batch` (decoding sequences first); `shared` maps a follower's index to its
    leader's."""
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    last: list[int] = []  # per sequence: the packed position whose logits it samples from
    fed: list[tuple[int, int]] = []  # per sequence: the packed range of the tokens it fed
    n_decode = 0
    for i, s in enumerate(batch):
        lead = shared.get(i)
        if lead is not None:
            last.append(last[lead])
            fed.append(fed[lead])
            continue
        start, n = len(ids), len(s.tokens) - s.computed
        if n == 1 and not spans:
            n_decode += 1
            ids.append(s.tokens[-1])
            pos.append(s.computed)
            rows.append(s.row)
        else:
            spans.append((start, n, s.row, s.computed))
            ids.extend(s.tokens[s.computed :])
            pos.extend(range(s.computed, len(s.tokens)))
            rows.extend([s.row] * n)
        last.append(len(ids) - 1)
        fed.append((start, len(ids)))
    dev = device
    positions = torch.tensor(pos, device=dev)
    decode_rows = rows[:n_decode]
    decode_lens = [p + 1 for p in pos[:n_decode]]
    decode_max = max(decode_lens, default=0)
    lens_t = torch.tensor(decode_lens, device=dev)
    # lockstep decodes (a group that joined together) need no mask: the cheaper attention kernel
    mask = None if all(n == decode_max for n in decode_lens) else (
        torch.arange(decode_max, device=dev)[None, :] < lens_t[:, None])
    batched, single = group_fresh_spans(spans, dev)
    layout = _StepLayout(
        n_decode=n_decode,
        decode_rows=None if decode_rows == list(range(n_decode)) else torch.tensor(decode_rows, device=dev),
        decode_lens=lens_t, decode_max=decode_max,
        slots=torch.tensor(rows, device=dev), positions=positions, spans=spans, cache=cache,
        decode_mask=mask, batched=batched, single=single,
    )
    return PackedStep(ids, layout, last, fed)
