"""From buffer `Trajectory` messages to packed model inputs and per-sequence loss tensors.

Packing: sequences (prompt + completion) are laid end to end in one row per micro-batch, with position
ids restarting at 0 for each, so the model never pads and never attends across sequences (transformers
builds the block-diagonal mask from the position ids when no attention mask and no cache are given).
Micro-batches are filled first-fit-decreasing up to a token budget. Loss tensors are per sequence,
[B, T] over completion tokens only, which is what tidal-algos' losses take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.protocol import Trajectory


@dataclass
class Sample:
    """One trajectory as the learner uses it."""

    id: str
    group_id: str
    prompt: np.ndarray  # int32 [P]
    completion: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T] sampler's processed logprobs
    versions: np.ndarray  # int32 [T]
    reward: float
    loss_mask: np.ndarray  # bool [T]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)

    @classmethod
    def from_trajectory(cls, t: Trajectory) -> Sample:
        completion = t.completion_ids.numpy()
        mask = np.ones(len(completion), bool) if t.loss_mask is None else t.loss_mask.numpy().astype(bool)
        # logprobs are copied out of the received frame (read-only memory): torch wants writable arrays
        return cls(id=t.id, group_id=t.group_id, prompt=t.prompt_ids.numpy(), completion=completion,
                   logprobs=t.logprobs.numpy().copy(), versions=t.versions.numpy(), reward=float(t.reward),
                   loss_mask=mask)


@dataclass
class Micro:
    """One packed forward: `input_ids`/`position_ids` [1, L]; `index` the samples it holds, in order;
    `spans` (start, prompt_len, completion_len) of each inside the row."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: list[int]
    spans: list[tuple[int, int, int]]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(samples: Sequence[Sample], max_tokens: int, device: torch.device | str = "cpu") -> list[Micro]:
    """First-fit-decreasing packing of whole sequences into rows of at most `max_tokens` (a longer
    sequence gets a row of its own). Order inside a row follows the input order, so results are
    deterministic for a given batch."""
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].length, i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = samples[i].length
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    micros = []
    for row in rows:
        row.sort()
        ids, pos, spans = [], [], []
        for i in row:
            s = samples[i]
            spans.append((len(ids), len(s.prompt), len(s.completion)))
            ids.extend(s.prompt.tolist())
            ids.extend(s.completion.tolist())
            pos.extend(range(s.length))
        micros.append(Micro(torch.tensor([ids], device=device), torch.tensor([pos], device=device), row, spans))
    return micros


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors into [len(rows), width], padding with `value`."""
    out = rows[0].new_full((len(rows), width), value) if rows else torch.zeros(0, width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def completion_logprobs(logits: torch.Tensor, micro: Micro, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample logprobs [T_i] of the completion tokens from packed `logits` [1, L, V] (fp32,
    temperature-scaled as the sampler was), and optionally the entropy at each of those positions."""
    ids = micro.input_ids[0]
    lps, ents = [], ([] if with_entropy else None)
    for start, p, t in micro.spans:
        # the logit at position j predicts token j + 1
        pred = logits[0, start + p - 1 : start + p - 1 + t].float()
        if temperature != 1.0:
            pred = pred / temperature
        logp = torch.log_softmax(pred, dim=-1)
        lps.append(logp.gather(1, ids[start + p : start + p + t, None].long())[:, 0])
        if ents is not None:
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents
