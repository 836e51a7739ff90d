#!/usr/bin/env bash
# GPU check for tidal-rollout, for a machine with an NVIDIA GPU (never part of CI).
#
#   tools/gpu/rollout_check.sh            # from the repo root; writes a report to ${OUT:-/tmp}/rollout_gpu.txt
#
# 1. embedded engine on CUDA: processed-logprob parity against a teacher-forced forward (fp32, and bf16
#    with the fp32 lm_head), an in-flight update, and tokens/s against model.generate on a bigger model;
# 2. the vLLM adapter, when vLLM imports there: the same tier tests CI runs on CPU (test_vllm.py).
#
# The machine needs torch with CUDA, transformers, numpy, pyzmq, msgspec, pluggy, xxhash, safetensors.
# Wheels for the missing ones can be put in .whl/ (pip download ... --python-version 3.12); they are
# installed from there without an index.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp}"
REPORT="$OUT/rollout_gpu.txt"
PY="${PYTHON:-python3}"

if [[ -d .whl ]]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl pyzmq msgspec pluggy xxhash 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/packages/core/src:$PWD/packages/weight-sync/src:$PWD/packages/rollout/src${PYTHONPATH:+:$PYTHONPATH}"

{
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"

echo "== embedded engine on CUDA"
"$PY" - <<'PY'
import tempfile, time, torch
from transformers import AutoModelForCausalLM
from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import SamplingParams
from tidal.rollout.engines.embedded import EmbeddedEngine
from tidal.rollout.engines.logprobs import teacher_forced_logprobs
from tidal.rollout.tiny import build_tiny_model

path = build_tiny_model(tempfile.mkdtemp() + "/m", hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816,
                        max_positions=1024)
g = torch.Generator().manual_seed(0)
def reqs(tag, n, **kw):
    return [GenerationRequest(request_id=f"{tag}{i}", prompt_ids=torch.randint(3, 70, (32,), generator=g).tolist(),
            sampling=SamplingParams(temperature=[0.7, 1.0][i % 2], top_p=[0.9, 1.0][(i // 2) % 2], seed=i, **kw))
            for i in range(n)]
for dtype, fp32_head in (("float32", False), ("bfloat16", True)):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    with EmbeddedEngine(path, device="cuda", dtype=dtype, max_num_seqs=64, fp32_lm_head=fp32_head) as eng:
        rs = reqs(dtype, 32, max_tokens=64)
        res = {r.request_id: r for r in eng.generate(rs, timeout=600)}
        worst = max((teacher_forced_logprobs(ref, q.prompt_ids, res[q.request_id].completion_ids, q.sampling,
                     fp32_lm_head=fp32_head).cpu() - torch.tensor(res[q.request_id].logprobs)).abs().max().item()
                    for q in rs)
        print(f"parity {dtype} (fp32 lm_head={fp32_head}): max |dlogp| {worst:.2e}")
        state = {k: v * 0.99 for k, v in ref.state_dict().items()}
        long = reqs("u" + dtype, 64, max_tokens=256, ignore_eos=True)
        for r in long:
            eng.submit(r)
        time.sleep(0.5)
        eng.update_weights(state.items(), version=1)
        print(f"in-flight update pause ({dtype}): {eng.stats['last_update_pause_s'] * 1e3:.2f} ms")
        done = 0
        while done < len(long):
            done += len(eng.poll(timeout=60))
    del ref
    torch.cuda.empty_cache()
PY

echo "== engine vs model.generate on CUDA (bigger model)"
CUDA_VISIBLE_DEVICES=0 "$PY" tools/bench/engine.py --requests 512 --concurrency 128 --hidden 1024 --layers 8 --reps 2 2>&1 | grep -v "Loading\|Writing"

echo "== vLLM tier"
if "$PY" -c "import vllm" 2>/dev/null; then
    TIDAL_REQUIRE_VLLM=1 "$PY" -m pytest -p no:cacheprovider -m vllm packages/rollout/tests/test_vllm.py -v -s -o addopts="" 2>&1 | grep -v "^(EngineCore\|^(Worker" | tail -40
else
    echo "vLLM does not import here: the vLLM path was NOT checked on this GPU"
fi
} 2>&1 | tee "$REPORT"
