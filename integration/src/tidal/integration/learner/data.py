"""From buffer `Trajectory` messages to packed model inputs and per-sequence loss tensors.

Packing: sequences (prompt + completion) are laid end to end in one row per micro-batch, with position
ids restarting at 0 for each, so the model never pads and never attends across sequences. Each row
carries its `VarlenLayout` (tidal.seqpar.varlen): under the learner's default attention (`tidal_varlen`)
a row costs what its sequences cost (Σ len²), not what a dense mask over the row would (row_len²).
Micro-batches are filled first-fit-decreasing up to a token budget. Logits are computed only at the
positions that predict completion tokens (`Micro.pred`); loss tensors are per sequence, [B, T] over
completion tokens only, which is what tidal-algos' losses take (`Micro.padded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.episodes import ROLE_KEY
from tidal.core.protocol import BASELINE_KEY, NO_VERSION, SamplingParams, Trajectory
from tidal.rollout.engines.sampling import processed_entropy, processed_logprobs, unpack_kept_mask
from tidal.seqpar.layout import ShardLayout
from tidal.seqpar.varlen import Item, VarlenLayout


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
    sampling: SamplingParams | None = None  # how the sampler processed its logits (None: unknown)
    kept: np.ndarray | None = None  # uint8 [T, ceil(V/8)] packed vocabulary the sampler kept per token
    routing: np.ndarray | None = None  # int [T, moe layers, k] experts the sampler used for each token
    step_rewards: np.ndarray | None = None  # float32 [S] process rewards of a multi-turn sample's steps
    step_ends: np.ndarray | None = None  # int32 [S] completion index (exclusive) where each step ended
    # int32 [T] per token the oldest policy version in the KV cache it attended to (NO_VERSION: not
    # sampled); None = its producer did not record it
    kv_versions: np.ndarray | None = None
    baseline: bool = False  # its group's greedy baseline member (ReMax): scored, never trained
    # "<task>/<role>" of a multi-role (self-play) episode's sample, e.g. "nim/first": the key of RAE's
    # baselines; "" = no role (metadata tidal.role unset)
    role_key: str = ""

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
                   loss_mask=mask, sampling=t.sampling,
                   kept=None if t.sampling_mask is None else t.sampling_mask.numpy(),
                   routing=None if t.routing is None else t.routing.numpy(),
                   step_rewards=None if t.step_rewards is None else t.step_rewards.numpy(),
                   step_ends=None if t.step_ends is None else t.step_ends.numpy(),
                   kv_versions=None if t.kv_versions is None else t.kv_versions.numpy(),
                   baseline=t.metadata.get(BASELINE_KEY) == "greedy",
                   role_key=f"{t.task}/{role}" if (role := t.metadata.get(ROLE_KEY)) else "")


@dataclass
class Processing:
    """The sampler's processing of each of a micro-batch's N completion tokens, for recomputing
    their logprobs exactly as sampled (tidal.rollout.engines.sampling.processed_logprobs)."""

    temperature: torch.Tensor  # float32 [N]
    top_k: torch.Tensor  # int64 [N]; <= 0 = off
    top_p: torch.Tensor  # float32 [N]; 1 = off
    kept: np.ndarray | None = None  # uint8 [N, ceil(V/8)] the vocabulary each token's sampler kept
    has_kept: torch.Tensor | None = None  # bool [N]: which tokens `kept` speaks for (the others recompute the cut)

    @classmethod
    def of(cls, samples: Sequence[Sample], index: list[int], sizes: list[int], fallback: SamplingParams,
           device: torch.device | str) -> Processing | None:
        params = [samples[i].sampling or fallback for i in index]
        plain = all(p.temperature == 1.0 and not 0 < p.top_k and p.top_p >= 1.0 for p in params)
        with_kept = [(kept := samples[i].kept) is not None and len(kept) == t for i, t in zip(index, sizes, strict=True)]
        if plain and not any(with_kept):
            return None

        def per_token(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(values, dtype=dtype), torch.tensor(sizes)).to(device)

        kept = has = None
        if any(with_kept):
            width = next(k.shape[1] for i, w in zip(index, with_kept, strict=True) if w and (k := samples[i].kept) is not None)
            kept = np.concatenate([samples[i].kept if w else np.full((t, width), 255, np.uint8)
                                   for i, t, w in zip(index, sizes, with_kept, strict=True)])
            has = per_token([int(w) for w in with_kept], torch.bool)
        return cls(per_token([p.temperature for p in params], torch.float32),
                   per_token([p.top_k for p in params], torch.int64),
                   per_token([p.top_p for p in params], torch.float32), kept, has)

    def select(self, index: torch.Tensor) -> Processing:
        """The processing of the tokens at `index` (a subset of the N, e.g. one sequence-parallel rank's)."""
        at = index.to(self.temperature.device)
        return Processing(self.temperature[at], self.top_k[at], self.top_p[at],
                          None if self.kept is None else self.kept[index.cpu().numpy()],
                          None if self.has_kept is None else self.has_kept[at])


@dataclass
class Micro:
    """One packed forward: `input_ids`/`position_ids` [1, L]; `index` the samples it holds, in order;
    `spans` (start, prompt_len, completion_len) of each (start −1 for a completion after a shared
    prompt: read positions through `pred`); `layout` the row's segments for
    variable-length attention; `pred` [N] the row positions whose logits predict the N completion
    tokens (all samples', in order), `targets` [N] those tokens; `rows`/`cols` [N] where each lands in the
    per-sequence [len(index), width] loss tensors."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: list[int]
    spans: list[tuple[int, int, int]]
    layout: VarlenLayout | ShardLayout | None = None  # ShardLayout: a shard of a row (sequence parallelism)
    pred: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    width: int = 0
    processing: Processing | None = None  # per completion token, how its sampler processed logits; None = plain

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def padded(self, flat: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """[N] per-completion-token values (in `pred` order) -> [len(index), width], padded with `value`
        (differentiable: an index_put, not a loop)."""
        out = flat.new_full((len(self.index), self.width), value)
        return out.index_put((self.rows, self.cols), flat)


def pack(samples: Sequence[Sample], max_tokens: int, device: torch.device | str = "cpu",
         share_prefix: bool = False, fallback: SamplingParams | None = None) -> list[Micro]:
    """First-fit-decreasing packing into rows of at most `max_tokens` (a longer unit gets a row of its
    own). A unit is one sequence, or with `share_prefix` the samples of a group that share their prompt:
    the prompt once, then each completion (needs `tidal_varlen` attention and the micro-batch's layout;
    a group larger than `max_tokens` is split, each part repeating the prompt). Order inside a row
    follows the input order, so results are deterministic for a given batch. `fallback`: the processing
    assumed for samples that do not say how they were sampled (default: plain temperature 1)."""
    units = _units(samples, max_tokens) if share_prefix else [[i] for i in range(len(samples))]
    size = [_unit_tokens(samples, u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-size[u], units[u][0]))
    rows: list[list[int]] = []
    room: list[int] = []
    for u in order:
        for r, free in enumerate(room):
            if size[u] <= free:
                rows[r].append(u)
                room[r] -= size[u]
                break
        else:
            rows.append([u])
            room.append(max_tokens - size[u])
    fallback = fallback or SamplingParams()
    return [_micro(samples, [units[u] for u in sorted(row, key=lambda u: units[u][0])], device, fallback)
            for row in rows]


def _units(samples: Sequence[Sample], max_tokens: int) -> list[list[int]]:
    """Samples of one group with the same prompt, in chunks that fit `max_tokens` with their prompt."""
    groups: dict[tuple[str, bytes], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.group_id, s.prompt.tobytes()), []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        if len(samples[members[0]].prompt) == 0:
            units.extend([i] for i in members)  # nothing to share (and no token to predict the first from)
            continue
        chunk: list[int] = []
        for i in members:
            if chunk and _unit_tokens(samples, [*chunk, i]) > max_tokens:
                units.append(chunk)
                chunk = []
            chunk.append(i)
        units.append(chunk)
    return units


def _unit_tokens(samples: Sequence[Sample], unit: list[int]) -> int:
    return len(samples[unit[0]].prompt) + sum(len(samples[i].completion) for i in unit)


def _micro(samples: Sequence[Sample], units: list[list[int]], device: torch.device | str,
           fallback: SamplingParams) -> Micro:
    ids, pos, items, pred, index, sizes, spans = [], [], [], [], [], [], []
    start = 0
    for unit in units:
        prompt = samples[unit[0]].prompt
        p = len(prompt)
        ids.append(prompt)
        pos.append(np.arange(p))
        if len(unit) == 1:  # a plain sequence: prompt and completion as one segment
            t = len(samples[unit[0]].completion)
            items.append(Item(start, p + t))
            ids.append(samples[unit[0]].completion)
            pos.append(np.arange(p, p + t))
            pred.append(np.arange(start + p - 1, start + p - 1 + t))  # the logit at j predicts token j + 1
            index.append(unit[0])
            sizes.append(t)
            spans.append((start, p, t))
            start += p + t
            continue
        if p:
            items.append(Item(start, p))
        prefix, start = start, start + p
        for i in unit:  # each completion sees the prompt and itself; its first token is predicted by the
            c = samples[i].completion  # prompt's last position
            t = len(c)
            if t:
                items.append(Item(start, t, prefix, p))
            ids.append(c)
            pos.append(np.arange(p, p + t))
            pred.append(np.concatenate([[prefix + p - 1], np.arange(start, start + t - 1)])[:t])
            index.append(i)
            sizes.append(t)
            spans.append((-1, p, t))  # no contiguous prompt + completion of its own in this row
            start += t
    ids_np = np.concatenate(ids).astype(np.int64)
    targets = np.concatenate([samples[i].completion for i in index]).astype(np.int64)
    ids_t = torch.from_numpy(ids_np)[None].to(device)
    rows = np.repeat(np.arange(len(index)), sizes)
    cols = np.concatenate([np.arange(t) for t in sizes]) if sizes else np.zeros(0, np.int64)
    return Micro(ids_t, torch.from_numpy(np.concatenate(pos))[None].to(device), index, spans,
                 layout=VarlenLayout.from_items(items, device=device),
                 pred=torch.from_numpy(np.concatenate(pred).astype(np.int64)).to(device),
                 targets=torch.from_numpy(targets).to(device), rows=torch.from_numpy(rows).to(device),
                 cols=torch.from_numpy(cols).to(device), width=max(sizes, default=0),
                 processing=Processing.of(samples, index, sizes, fallback, device))


def kv_lags(micro: Micro, ss: Sequence[Sample], version: int, dev: torch.device | str) -> torch.Tensor | None:
    """[rows, width] `version` (the learner's) minus the oldest version in the KV cache each token of the
    micro-batch's samples `ss` attended to (`Sample.kv_versions`); 0 where not sampled. None when none of
    them carries kv_versions. A sample without them (another engine's) counts its sampling version: its
    KV is at least that old."""
    if all(s.kv_versions is None for s in ss):
        return None
    kv = np.concatenate([s.versions if s.kv_versions is None else s.kv_versions for s in ss]).astype(np.int64)
    flat = torch.from_numpy(np.where(kv > NO_VERSION, version - kv, 0)).to(dev)
    return micro.padded(flat, 0)


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors into [len(rows), width], padding with `value`."""
    out = rows[0].new_full((len(rows), width), value) if rows else torch.zeros(0, width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def token_logprobs(logits: torch.Tensor, micro: Micro, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [N] of the micro-batch's completion tokens (all samples', in `pred` order), fp32 and
    processed exactly as each token's sampler processed them (temperature, top-k, top-p, or the very
    vocabulary it kept), and optionally the entropy of that processed distribution at each position.
    `logits`: [1, L, V] over the whole row, or [1, N, V] already taken at `micro.pred`."""
    assert micro.pred is not None and micro.targets is not None
    pred = logits[0] if logits.shape[1] == len(micro.pred) else logits[0, micro.pred]
    pred = pred.float()
    proc = micro.processing
    if proc is None:  # plain temperature-1 sampling: the model's own distribution
        logp = torch.log_softmax(pred, dim=-1)
    else:
        logp = processed_logprobs(pred, proc.temperature, proc.top_k, proc.top_p)
        if proc.kept is not None and proc.has_kept is not None:
            vocab = pred.shape[-1]
            if proc.kept.shape[1] * 8 < vocab:
                raise ValueError(f"a trajectory's sampling_mask covers {proc.kept.shape[1] * 8} vocabulary entries "
                                 f"but the learner's model has {vocab}: sampler and learner run different models")
            kept = torch.from_numpy(unpack_kept_mask(proc.kept, vocab)).to(pred.device)
            replay = processed_logprobs(pred, proc.temperature, proc.top_k, proc.top_p, kept=kept)
            logp = torch.where(proc.has_kept[:, None], replay, logp)
    lp = logp.gather(1, micro.targets[:, None])[:, 0]
    ent = processed_entropy(logp) if with_entropy else None
    return lp, ent


def completion_logprobs(logits: torch.Tensor, micro: Micro, with_entropy: bool = False
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """`token_logprobs` split per sample: logprobs [T_i] of each sample's completion tokens."""
    lp, ent = token_logprobs(logits, micro, with_entropy)
    sizes = [t for _, _, t in micro.spans]
    return list(lp.split(sizes)), (list(ent.split(sizes)) if ent is not None else None)
