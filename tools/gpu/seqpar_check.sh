#!/usr/bin/env bash
# GPU check for tidal-seqpar, for a machine with NVIDIA GPUs (never part of CI; CI has no GPU).
#
#   tools/gpu/seqpar_check.sh            # from the repo root; writes a report to ${OUT:-/tmp}/seqpar_gpu.txt
#
# 1. kernels on CUDA, one process: the flash-attn backend (when flash_attn imports) against the math
#    backend in bf16 — packed sequences, causal, GQA, forward and q/k/v gradients; math and sdpa in fp32
#    against the plain reference (sinks included) within 1e-5;
# 2. NCCL, when there are >= 2 GPUs: the same cases as the gloo test suite (packages/seqpar/tests/sp_worker.py,
#    Ulysses, ring, hybrid, tiny Qwen2) over 2 (and 4) ranks, one GPU each, checked against 1e-5.
#
# The machine needs torch with CUDA, transformers and msgspec, pyzmq, pluggy (tidal-core's imports).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp}"
REPORT="$OUT/seqpar_gpu.txt"
PY="${PYTHON:-python3}"
if [[ -d .whl ]]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl pyzmq msgspec pluggy 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/packages/core/src:$PWD/packages/seqpar/src:$PWD/packages/seqpar/tests${PYTHONPATH:+:$PYTHONPATH}"

{
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== kernels on CUDA"
"$PY" - <<'PY'
import torch
from reference import attention as ref_attention
from tidal.seqpar import SPMesh, plan_layout, sp_attention

mesh = SPMesh.single()
g = torch.Generator().manual_seed(0)
b, hq, hkv, s, d = 2, 8, 2, 1000, 64
pos = torch.cat([torch.arange(300), torch.arange(450), torch.arange(250)])[None].expand(b, s).cuda()
layout = plan_layout(s, mesh, batch=b, position_ids=pos)
def inputs(dtype):
    t = [torch.randn(b, h, s, d, generator=g).to("cuda", dtype).requires_grad_() for h in (hq, hkv, hkv)]
    return t + [torch.randn(b, hq, s, d, generator=g).to("cuda", dtype)]
q, k, v, w = inputs(torch.float32)
sinks = torch.randn(hq, generator=g).cuda().requires_grad_()
ref = ref_attention(q, k, v, pos, causal=True, sinks=sinks)
want = torch.autograd.grad((ref * w).sum(), [q, k, v, sinks])
for backend in ("math", "sdpa"):
    out = sp_attention(q, k, v, layout, mesh, sinks=sinks, backend=backend)
    got = torch.autograd.grad((out * w).sum(), [q, k, v, sinks])
    err = max([(out - ref).abs().max().item()] + [(a - r).abs().max().item() for a, r in zip(got, want)])
    print(f"{backend} fp32 with sinks vs reference: max |diff| {err:.2e} {'ok' if err < 1e-5 else 'FAIL'}")
try:
    import flash_attn  # noqa: F401
except ImportError:
    print("flash-attn does not import here: the flash path was NOT checked on this GPU")
else:
    q, k, v, w = inputs(torch.bfloat16)
    outs = {}
    for backend in ("math", "flash"):
        out = sp_attention(q, k, v, layout, mesh, backend=backend)
        outs[backend] = (out.float(), [x.float() for x in torch.autograd.grad((out * w).sum(), [q, k, v])])
    (om, gm), (of, gf) = outs["math"], outs["flash"]
    err = max([(om - of).abs().max().item()] + [(a - c).abs().max().item() for a, c in zip(gm, gf)])
    print(f"flash vs math, bf16, packed causal GQA: max |diff| {err:.2e} {'ok' if err < 2e-2 else 'FAIL'}")
PY

echo "== NCCL"
NGPU=$(nvidia-smi -L | wc -l)
for WORLD in 2 4; do
    if (( NGPU < WORLD )); then echo "$NGPU GPU(s): the $WORLD-rank NCCL run was NOT checked"; continue; fi
    PORT=$((29500 + WORLD))
    for ((r = 0; r < WORLD; r++)); do
        TIDAL_SP_DEVICE=cuda timeout 600 "$PY" packages/seqpar/tests/sp_worker.py $r $WORLD $PORT "$OUT/seqpar_nccl_$WORLD.json" &
    done
    wait
    "$PY" -c "
import json, sys; d = json.load(open('$OUT/seqpar_nccl_$WORLD.json'))
bad = {k: v for k, v in d.items() if max(v.get('out', v.get('loss')), v['grad']) >= 1e-5}
print('$WORLD ranks NCCL:', len(d), 'cases,', 'all within 1e-5' if not bad else f'FAIL {bad}')"
done
} 2>&1 | tee "$REPORT"
