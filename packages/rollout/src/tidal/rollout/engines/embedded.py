"""The embedded engine: continuous batching over a Hugging Face causal LM, in this process.

One background thread runs the loop. Each step is one forward over a packed row: every decoding
sequence feeds its last token, and sequences that just joined (or whose KV must be rebuilt) feed all
their pending tokens, each with its own position ids. Finished sequences leave after the step that
finished them and waiting ones join before the next, so no sequence waits for the longest and nothing
is padded to it.

The G samples of a group share their prompt: sequences whose tokens are identical and that join in the
same step are prefilled once (the first feeds the prompt; the others take its keys/values and its
next-token logits, then sample with their own seeds and parameters). `submit_many` queues a group at
once so that it joins together. Fresh prefills of one length attend as one batch.

The KV cache is the engine's own: per layer a `[max_num_seqs, kv_heads, max_model_len, head_dim]`
tensor whose first `n` rows are the `n` running sequences (rows freed in a step are refilled by the
sequences above the new count, so the live rows stay contiguous and a decode reads them as a view).
Attention reaches it through transformers' attention-function registry
(`attn_implementation="tidal_packed"`), so any
transformers decoder that dispatches through that registry (Llama, Qwen2/3, Mistral, Mixtral, ...)
runs unmodified.

A request with stop strings (`SamplingParams.stop`) decodes, after each of its tokens, only the few
trailing tokens that can hold a stop string (`tidal.rollout.engines.stops`), with the model folder's tokenizer,
loaded by the first such request; requests without stop strings decode nothing.

Weight updates land between two steps: `update_weights` blocks until the loop has copied the tensors
into the model (the pause), and every token sampled afterwards carries the new version. What happens to
sequences in flight is the partial-rollout mode:

- ``continue``: keep going on the KV cache built by the old weights (mixed versions, as PipelineRL);
  each token's `kv_versions` entry keeps the version that built the cache, older than its `versions` one;
- ``recompute``: keep the tokens, rebuild their KV cache with the new weights, then continue;
- ``retry``: throw the partial completion away and start again from the prompt with the new weights;
- ``drop``: finish them at once with finish reason ``"abort"`` (the caller discards them).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tidal.core.interfaces import GenerationRequest, GenerationResult, NamedTensors
from tidal.core.protocol import WeightsAvailable
from tidal.rollout.engines.attention import ATTN_IMPL, _ctx, _KVCache, _register_attention
from tidal.rollout.engines.common import generate
from tidal.rollout.engines.lora import AdapterError, AdapterMerger
from tidal.rollout.engines.packing import _Seq, pack_step
from tidal.rollout.engines.sampling import kept_mask_bits, process_logits, sample
from tidal.rollout.engines.stops import stop_string_ended, stop_window
from tidal.rollout.engines.weights import ReceiverPool
from tidal.rollout.tiny import load_tokenizer

log = logging.getLogger("tidal.rollout.engine")

PartialMode = Literal["continue", "recompute", "retry", "drop"]
PARTIAL_MODES: tuple[str, ...] = ("continue", "recompute", "retry", "drop")
class EngineError(RuntimeError):
    """A request or update the engine cannot take; the message says what to change."""


# --------------------------------------------------------------------------- weight updates


@dataclass
class _Update:
    weights: NamedTensors
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    pause_s: float = 0.0


class EmbeddedEngine:
    """Continuous-batching generation over a local Hugging Face causal LM (see the module docstring).

    `model` is a folder (or an already-built `PreTrainedModel`, which the engine then owns). Requests go
    in with `submit`, finished results come out of `poll` (or `generate` for a blocking convenience).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 4096,
        fp32_lm_head: bool = False,
        partial_mode: PartialMode = "continue",
        seed: int = 0,
        version: int = 0,
        stop_on_eos: bool = True,
        share_prompts: bool = True,
        weight_transport_options: dict[str, dict[str, Any]] | None = None,
        tokenizer: Any = None,
    ) -> None:
        if partial_mode not in PARTIAL_MODES:
            raise EngineError(f"partial_mode {partial_mode!r} is not one of {', '.join(PARTIAL_MODES)}")
        _register_attention()
        self.device = torch.device(device)
        self.model = self._load(model, dtype)
        self._adapters = AdapterMerger(dict(self.model.named_parameters()))  # LoRA payloads (learner.lora)
        # stop strings need decoding: the model folder's tokenizer, loaded by the first request that has
        # some, so that requests without any pay nothing
        self._tokenizer = tokenizer
        self._tokenizer_path = None if isinstance(model, torch.nn.Module) else Path(model)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(max_model_len) if max_model_len else int(getattr(cfg, "max_position_embeddings", 2048))
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.fp32_lm_head = fp32_lm_head
        self.partial_mode: PartialMode = partial_mode
        self.share_prompts = share_prompts  # identical fresh prompts in one step are prefilled once
        self.seed = seed
        eos = cfg.eos_token_id if stop_on_eos else None
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._version = version
        self._receivers = ReceiverPool(weight_transport_options)
        self._cache = _KVCache(max_num_seqs, self.max_model_len)
        # A 4-D mask is taken as already built, so transformers skips its mask preparation (which scans
        # the position ids for packed sequences, every step); the attention ignores it.
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self._router_outputs: list[torch.Tensor] = []
        self._routers = self._hook_routers()
        self._init_loop_state()
        self._thread = threading.Thread(target=self._loop, name="tidal-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ setup

    def _init_loop_state(self) -> None:
        """What callers and the loop thread share (under `_lock`): the queues, the flags and the stats."""
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._results: list[GenerationResult] = []
        self._updates: list[_Update] = []
        self._aborts: set[str] = set()
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self.stats: dict[str, float] = dict.fromkeys(
            ("steps", "prefill_steps", "decode_steps", "forward_s", "tokens_fed", "tokens_generated", "finished",
             "updates", "last_update_pause_s"), 0.0)

    def _load(self, model: str | Path | torch.nn.Module, dtype: str) -> Any:
        """The transformers causal LM, on the engine's device (Any: its config and decoder are per architecture)."""
        if isinstance(model, torch.nn.Module):
            built: Any = model  # a transformers PreTrainedModel
            built.set_attn_implementation(ATTN_IMPL)
            return built.to(self.device).eval()
        path = Path(model)
        if not (path / "config.json").is_file():
            raise EngineError(f"no model at {str(path)!r}: the embedded engine loads a local Hugging Face folder "
                              "(config.json + weights); build a tiny one with tidal.rollout.tiny.build_tiny_model")
        m: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=ATTN_IMPL)
        return m.to(self.device).eval()

    def _hook_routers(self) -> int:
        """Record MoE routing: every module named *Router returning (logits, scores, indices) is hooked."""
        count = 0
        for module in self.model.modules():
            if type(module).__name__.endswith("Router"):
                module.register_forward_hook(self._record_route)
                count += 1
        return count

    def _record_route(self, module: Any, args: Any, output: Any) -> None:
        if getattr(_ctx, "want_routing", False) and isinstance(output, tuple):
            idx = next((t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
            if idx is not None:
                self._router_outputs.append(idx.detach())

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest) -> None:
        self.submit_many([request])

    def submit_many(self, requests: Sequence[GenerationRequest]) -> None:
        """Submit `requests` together: they join the same step (a group's samples then share one prefill
        of their prompt). Nothing is queued if any of them is refused."""
        seqs = [self._new_seq(r) for r in requests]
        with self._lock:
            self._check_alive()
            self._waiting.extend(seqs)
            self._lock.notify_all()

    def _new_seq(self, request: GenerationRequest) -> _Seq:
        p = request.sampling
        if not request.prompt_ids:
            raise EngineError(f"request {request.request_id!r} has an empty prompt")
        if len(request.prompt_ids) >= self.max_model_len:
            raise EngineError(f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does not "
                              f"fit max_model_len={self.max_model_len}")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"request {request.request_id!r}: token ids {bad[:5]} outside the vocabulary "
                              f"(size {self.vocab_size})")
        if not 0.0 < p.top_p <= 1.0 or p.temperature < 0 or p.max_tokens < 1:
            raise EngineError(f"request {request.request_id!r}: sampling needs 0 < top_p <= 1, temperature >= 0 "
                              f"and max_tokens >= 1, got {p}")
        if p.return_routing and not self._routers:
            raise EngineError(f"request {request.request_id!r} asks for MoE routing but the model has no router")
        if p.stop:
            self._need_tokenizer(request.request_id)
        seed = p.seed if p.seed is not None else (self.seed * 1_000_003 + zlib.crc32(request.request_id.encode()))
        return _Seq(request, seed & 0x7FFFFFFFFFFF, list(request.prompt_ids), len(request.prompt_ids),
                    stop_window=stop_window(p.stop) if p.stop else 0)

    def _need_tokenizer(self, request_id: str) -> None:
        if self._tokenizer is not None:
            return
        if self._tokenizer_path is None:
            raise EngineError(f"request {request_id!r} has stop strings, which need a tokenizer to decode: pass "
                              "EmbeddedEngine(model, tokenizer=...) when the model is not a folder")
        try:
            self._tokenizer = load_tokenizer(self._tokenizer_path)
        except Exception as e:
            raise EngineError(f"request {request_id!r} has stop strings, which need the tokenizer of "
                              f"{str(self._tokenizer_path)!r}, and it does not load: {e}") from e

    def poll(self, timeout: float | None = None) -> list[GenerationResult]:
        """Results finished since the last call; waits up to `timeout` seconds for at least one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._results:
                self._check_alive()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._lock.wait(left)
            out, self._results = self._results, []
            return out

    def generate(self, requests: Iterable[GenerationRequest], timeout: float | None = None) -> Iterator[GenerationResult]:
        """Submit `requests` and yield their results as each finishes (not in submission order)."""
        return generate(self, requests, timeout)

    def update_weights(self, weights: NamedTensors, version: int, lora_scale: float | None = None) -> None:
        """Load `weights` between two decode steps and tag later tokens with `version`. Blocks until done;
        raises (and keeps the old weights) on a name or shape that does not match the model. `lora_scale`:
        `weights` are LoRA adapters (engines/lora.py), merged into the base weights with that scale."""
        if lora_scale is not None:
            try:
                weights = self._adapters.merged(weights, lora_scale)  # here: the engine does not pause for it
            except AdapterError as e:
                raise EngineError(f"weight update to version {version}: {e}; nothing was loaded") from None
        elif self._adapters.base:
            self._adapters.forget()  # full weights: adapters that come later merge into these
        upd = _Update(list(weights), version)
        with self._lock:
            self._check_alive()
            self._updates.append(upd)
            self._lock.notify_all()
        upd.done.wait()
        if upd.error is not None:
            raise upd.error

    def receive_weights(self, announcement: WeightsAvailable) -> int:
        """Fetch the announced version through its transport (by name, from the plugin registry), verify
        it, and load it between two steps. Returns the version now held; on a failed transfer the old
        weights stay and the error propagates (the sender has been told by the receiver)."""
        scale = announcement.lora_scale if announcement.lora_only else None
        return self._receivers.receive(announcement,
                                       lambda named: self.update_weights(named, announcement.version, scale))

    def cancel_receive(self) -> None:
        """Give up a `receive_weights` in progress (from another thread): it raises the transport's
        `WeightFetchCancelled` soon and the weights held stay."""
        self._receivers.cancel()

    def pause(self) -> None:
        """Stop stepping after the current step; requests stay queued and in flight."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these requests now with finish reason "abort" (unknown ids are ignored)."""
        with self._lock:
            self._aborts.update(request_ids)
            self._lock.notify_all()

    def load_state(self) -> dict[str, float]:
        """Gauges for heartbeats and metrics: running, waiting, tokens generated, ..."""
        with self._lock:
            out = dict(self.stats)
            out.update(running=len(self._running), waiting=len(self._waiting), version=self._version)
            return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)
        self._receivers.close()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineError(f"the engine loop failed: {self._error!r}") from self._error
        if self._closed:
            raise EngineError("the engine is closed")

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._updates and not self._aborts and (
                        self._paused or (not self._waiting and not self._running)
                    ):
                        self._lock.wait()
                    if self._closed:
                        self._finish_all("abort")
                        return
                    for upd in self._updates:
                        self._apply_update(upd)
                    self._updates.clear()
                    if self._aborts:
                        self._apply_aborts()
                    if self._paused:
                        continue
                    self._admit()
                    batch = self._schedule()
                if batch:
                    finished = self._step(*batch)
                    with self._lock:
                        self._finish_many(finished)
                        self._lock.notify_all()
        except BaseException as e:  # surfaced to callers by _check_alive
            log.exception("embedded engine loop failed")
            with self._lock:
                self._error = e
                for upd in self._updates:
                    upd.error = e
                    upd.done.set()
                self._lock.notify_all()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting.popleft()
            seq.row = len(self._running)
            self._running.append(seq)

    def _schedule(self) -> tuple[list[_Seq], dict[int, int]] | None:
        """Every decoding sequence, then the sequences that need a prefill (joined, or KV to rebuild) up to
        the prefill token budget: one forward serves both, so a joining sequence costs no extra step.

        A fresh sequence whose tokens equal an earlier one's in this step (the G samples of a group share
        their prompt) feeds nothing: it takes that one's keys/values and next-token logits, so a group's
        prompt is prefilled once. Returns the batch and {follower's index: leader's index}, or None."""
        decode = [s for s in self._running if len(s.tokens) - s.computed == 1]
        budget = self.max_prefill_tokens
        prefill: list[_Seq] = []
        shared: dict[int, int] = {}
        leaders: dict[tuple[int, ...], int] = {}
        for s in self._running:
            n = len(s.tokens) - s.computed
            if n > 1:
                key = tuple(s.tokens) if s.computed == 0 and self.share_prompts else None
                lead = leaders.get(key) if key is not None else None
                if lead is not None:
                    shared[len(decode) + len(prefill)] = lead
                    prefill.append(s)
                    continue
                if prefill and n > budget:
                    break
                if key is not None:
                    leaders[key] = len(decode) + len(prefill)
                prefill.append(s)
                budget -= n
        batch = decode + prefill
        return (batch, shared) if batch else None

    def _step(self, batch: list[_Seq], shared: dict[int, int]) -> list[tuple[_Seq, str]]:
        packed = pack_step(batch, shared, self._cache, self.device)
        ids, layout, last, fed = packed.ids, packed.layout, packed.last, packed.fed
        dev = self.device
        params = [s.req.sampling for s in batch]
        want_routing = any(p.return_routing for p in params)
        _ctx.step, _ctx.want_routing = layout, want_routing
        self._router_outputs.clear()
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                hidden = self.model.model(
                    input_ids=torch.tensor([ids], device=dev), position_ids=layout.positions[None], use_cache=False,
                    attention_mask=self._no_mask,
                ).last_hidden_state[0]
                if shared:  # followers take their leader's prompt keys/values (the leader's row is final now)
                    self._cache.move([batch[lead].row for lead in shared.values()], [batch[f].row for f in shared],
                                     max(len(batch[lead].tokens) for lead in shared.values()))
                logits = self._lm_head(hidden[torch.tensor(last, device=dev)])
                logp = process_logits(logits, params)
                seeds = torch.tensor([[s.seed, len(s.tokens) - s.prompt_len] for s in batch], device=dev)
                tokens = sample(logp, seeds[:, 0], seeds[:, 1])
                chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
        finally:
            _ctx.step = None
        tokens_l = tokens.tolist()
        masks = kept_mask_bits(logp) if any(p.return_sampling_mask for p in params) else None
        routes = torch.stack(self._router_outputs, dim=1).cpu().numpy() if want_routing else None  # [N, L, k]
        self.stats["steps"] += 1
        self.stats["prefill_steps" if layout.spans else "decode_steps"] += 1
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["tokens_fed"] += len(ids)
        self.stats["tokens_generated"] += len(batch)

        finished = []
        version = self._version
        for i, s in enumerate(batch):
            if s.computed == 0:  # this step wrote its whole KV cache (a follower's is its leader's, same step)
                s.kv_floor = version
            s.computed = len(s.tokens)
            tok = tokens_l[i]
            s.tokens.append(tok)
            s.logprobs.append(chosen[i])
            s.versions.append(version)
            s.kv_versions.append(s.kv_floor)
            p = params[i]
            if masks is not None and p.return_sampling_mask:
                s.masks.append(masks[i])
            if routes is not None and p.return_routing:
                s.routing.extend(routes[fed[i][0] : fed[i][1]])  # one route per fed position
            if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
                finished.append((s, "stop"))
            elif s.stop_window and stop_string_ended(
                    self._tokenizer, s.tokens[max(s.prompt_len, len(s.tokens) - s.stop_window):], p.stop):
                finished.append((s, "stop"))
            elif len(s.tokens) - s.prompt_len >= p.max_tokens or len(s.tokens) >= self.max_model_len:
                finished.append((s, "length"))
        return finished

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        if self.fp32_lm_head:
            bias = None if head.bias is None else head.bias.float()
            return F.linear(hidden.float(), head.weight.float(), bias)
        return head(hidden)

    # ------------------------------------------------------------------ state changes (under the lock)

    def _result(self, seq: _Seq, reason: str) -> GenerationResult:
        n = len(seq.completion)
        routing = None
        if seq.req.sampling.return_routing and seq.routing:
            # routes are recorded per fed token; completion token t is fed at position prompt_len + t,
            # which only happens for tokens before the last. The last token was never fed, so its route
            # is computed by one extra forward when the caller needs it; we report routes for the
            # positions that produced each completion token instead: position prompt_len - 1 + t.
            fed = np.stack(seq.routing)  # [tokens fed, L, k]
            routing = fed[seq.prompt_len - 1 : seq.prompt_len - 1 + n]
        return GenerationResult(
            request_id=seq.req.request_id,
            completion_ids=seq.completion,
            logprobs=seq.logprobs,
            versions=seq.versions,
            kv_versions=seq.kv_versions,
            finish_reason=reason,
            sampling_mask=np.stack(seq.masks) if seq.masks else None,
            routing=routing,
        )

    def _finish(self, seq: _Seq, reason: str) -> None:
        self._finish_many([(seq, reason)])

    def _finish_many(self, done: list[tuple[_Seq, str]]) -> None:
        for seq, reason in done:
            self._results.append(self._result(seq, reason))
        self.stats["finished"] += len(done)
        self._remove([seq for seq, _ in done if seq.row >= 0])

    def _remove(self, seqs: list[_Seq]) -> None:
        """Take `seqs` out of the running rows, keeping the live rows contiguous: survivors above the new
        count move down into the freed rows below it, with one cache copy for all of them."""
        if not seqs:
            return
        gone = set(map(id, seqs))
        n = len(self._running) - len(seqs)
        holes = sorted(s.row for s in seqs if s.row < n)
        movers = [s for s in self._running[n:] if id(s) not in gone]
        if movers:
            self._cache.move([s.row for s in movers], holes, max(s.computed for s in movers))
            for s, row in zip(movers, holes, strict=True):
                s.row = row
                self._running[row] = s
        del self._running[n:]
        for s in seqs:
            s.row = -1

    def _finish_all(self, reason: str) -> None:
        for seq in [*self._running, *self._waiting]:
            self._results.append(self._result(seq, reason))
        self._running.clear()
        self._waiting.clear()
        self._lock.notify_all()

    def _apply_aborts(self) -> None:
        ids, self._aborts = self._aborts, set()
        self._finish_many([(s, "abort") for s in self._running if s.req.request_id in ids])
        kept: collections.deque[_Seq] = collections.deque()
        for seq in self._waiting:
            if seq.req.request_id in ids:
                self._results.append(self._result(seq, "abort"))
            else:
                kept.append(seq)
        self._waiting = kept

    def _apply_update(self, upd: _Update) -> None:
        t0 = time.perf_counter()
        try:
            params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
            params.update(self.model.named_buffers())
            unknown = [n for n, _ in upd.weights if n not in params]
            wrong = [f"{n}: {tuple(t.shape)} != {tuple(params[n].shape)}" for n, t in upd.weights
                     if n in params and tuple(t.shape) != tuple(params[n].shape)]
            if unknown or wrong:
                raise EngineError(f"weight update to version {upd.version} does not fit the model: "
                                  f"unknown names {unknown[:5]}, wrong shapes {wrong[:5]}; nothing was loaded")
            if upd.version <= self._version:
                log.warning("weight update to version %d is not newer than %d; loading it anyway",
                            upd.version, self._version)
            with torch.no_grad():
                for name, tensor in upd.weights:
                    params[name].copy_(tensor)  # synchronous: the caller reuses the source buffers after
            self._version = upd.version
            self._after_update()
        except BaseException as e:
            upd.error = e
        finally:
            upd.pause_s = time.perf_counter() - t0
            self.stats["updates"] += 1
            self.stats["last_update_pause_s"] = upd.pause_s
            upd.weights = []
            upd.done.set()

    def _after_update(self) -> None:
        mode = self.partial_mode
        if mode == "continue":
            return
        if mode == "drop":
            self._finish_many([(seq, "abort") for seq in self._running])
            return
        for seq in self._running:
            if mode == "recompute":
                seq.computed = 0
                seq.routing.clear()
            elif mode == "retry":
                seq.tokens = seq.tokens[: seq.prompt_len]
                seq.computed = 0
                seq.logprobs, seq.versions, seq.kv_versions, seq.masks, seq.routing = [], [], [], [], []
