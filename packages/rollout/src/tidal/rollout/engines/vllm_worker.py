"""The part of the vLLM adapter that runs inside vLLM's worker process (`worker_extension_cls`).

vLLM mixes this class into its worker; the adapter calls its methods with `collective_rpc`. Weights
arrive here directly from the learner through tidal-weight-sync's receiver (found by transport name in
the plugin registry), and go into the model through vLLM's own `load_weights`, so no copy passes
through the adapter's process.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from tidal.core.protocol import WeightsAvailable
from tidal.rollout.engines.weights import ReceiverPool


class TidalWorkerExtension:
    """Methods vLLM adds to its worker. `self.model_runner` is vLLM's model runner."""

    model_runner: Any  # vLLM's model runner, set by the worker class this one is mixed into

    def _tidal_model(self) -> Any:
        """vLLM's model (lm_head, compute_logits, load_weights: vLLM's own, without type information)."""
        return self.model_runner.get_model()

    def tidal_setup(self, fp32_lm_head: bool) -> dict[str, Any]:
        """Called once after start. With `fp32_lm_head`, keep the output projection in fp32 and compute the
        logits from fp32 hidden states (bf16 logits blur the logprobs the learner compares against)."""
        model = self._tidal_model()
        if fp32_lm_head:
            head = model.lm_head
            head.weight.data = head.weight.data.float()
            original = model.compute_logits

            def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                return original(hidden_states.float(), *args, **kwargs)

            model.compute_logits = compute_logits
        return {"model": type(model).__name__, "lm_head_dtype": str(model.lm_head.weight.dtype)}

    def tidal_output_counts(self) -> dict[str, int]:
        """Tokens generated so far by each request the worker holds (vLLM's internal ids). Called while the
        scheduler is paused, so these are exactly the tokens made by the old weights."""
        requests = getattr(self.model_runner, "requests", {})
        return {rid: len(state.output_token_ids) for rid, state in requests.items()}

    def _tidal_load(self, named: Any) -> None:
        """vLLM's checkpoint-format reload: after start-up the CPU/GPU kernels may have repacked the
        parameters (they lose their weight loaders), so layerwise reload restores loadable parameters,
        `load_weights` fills them, and the finalize step re-runs the kernels' post-load processing."""
        # vllm is optional (tidal-rollout[vllm]); this runs only inside vLLM's worker, where it is present
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._tidal_model()
        named = list(named)  # decoded and verified before the model is touched
        initialize_layerwise_reload(model)
        try:
            model.load_weights(weights=iter(named))
        finally:  # even after a bad name, put the kernels back so the engine keeps serving
            finalize_layerwise_reload(model, self.model_runner.model_config)

    def tidal_load_weights(self, packed: list[tuple[str, str, list[int], bytes]]) -> dict[str, Any]:
        """Load tensors sent as (name, dtype, shape, raw bytes): plain bytes cross vLLM's RPC serialiser
        intact whatever its tensor support."""
        try:
            named = [(n, torch.frombuffer(bytearray(b), dtype=getattr(torch, d)).reshape(shape) if b else
                      torch.empty(shape, dtype=getattr(torch, d))) for n, d, shape, b in packed]
            self._tidal_load(named)
        except Exception as e:  # an exception escaping an RPC would kill vLLM's engine core
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "count": len(packed)}

    def tidal_receive_weights(self, announcement: bytes, options: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Fetch, verify and load an announced version (msgpack-encoded `WeightsAvailable`). A transfer
        that fails verification is reported (and the sender told by the receiver) before anything touches
        the model, which keeps its previous weights."""
        pool: ReceiverPool | None = getattr(self, "_tidal_receivers", None)
        if pool is None:
            pool = ReceiverPool(options)
            self._tidal_receivers = pool
        try:
            ann = msgspec.msgpack.decode(announcement, type=WeightsAvailable)
            version = pool.receive(ann, self._tidal_load)
        except Exception as e:  # an exception escaping an RPC would kill vLLM's engine core
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "version": version}
