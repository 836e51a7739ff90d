#!/usr/bin/env bash
# GPU check for tidal-weight-sync, for a machine with one NVIDIA GPU (never part of CI; CI has no GPU).
#
#   tools/gpu/weight_sync_check.sh        # from the repo root; writes ${OUT:-/tmp}/weight_sync_gpu.txt (+ .json)
#
# 0. the pair driver below over host-memory transports (gloo, shm) at a small size: runs anywhere, so
#    the driver itself is known to work where the GPU parts cannot run;
# a. torch_dist between two processes on the one GPU: backend NCCL (NCCL >= 2.5 refuses two ranks on
#    one GPU, "Duplicate GPU detected": the attempt is recorded as it fails; with WS_NCCL_DEVICES=0,1 on
#    a two-GPU machine the receiver takes the second GPU and the NCCL path runs), then gloo carrying CUDA
#    tensors (device="cuda" on both ends); bit-identical fp32 and bf16, timing for a ${WS_GIB:-1} GiB state.
#    These pairs run torch_dist's streamed broadcast on the GPU (each bucket broadcast as soon as it is
#    packed, per-bucket headers in GPU memory, the receiver's taking thread woken through the TCPStore);
#    the NCCL pairs are the only check of it over NCCL, and the report says whether they ran.
#    Every torch_dist pair on CUDA must take the device-verify path: buckets packed and checked with
#    mix64-sum in GPU memory, never copied to the host to be verified (the sender's report names the
#    checksum and whether the receiver got its buckets as GPU tensors: "device_verify");
# b. cuda_ipc between two processes: bit-identical fp32 and bf16, timing against a device-to-device copy
#    of the same bytes, and the GPU tests of the package (pytest, when it imports);
# c. tools/bench/weight_sync.py (host-memory transports beside memcpy and per-parameter baselines).
# Each step has a time limit and all of them keep to WS_BUDGET (450 s); a part that needs CUDA says
# "needs CUDA" and the script goes on. Every process a step starts is gone when the step ends.
#
# The machine needs torch with CUDA and numpy, msgspec, pyzmq, pluggy, xxhash, safetensors (pytest for
# the package's GPU tests). Wheels for the missing ones can be put in .whl/ (pip download ...
# --python-version 3.12); they are installed from there without an index.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
REPORT="$OUT/weight_sync_gpu.txt"
JSON="$OUT/weight_sync_gpu.json"
PY="${PYTHON:-python3}"
GIB="${WS_GIB:-1}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
: > "$JSON"

if [[ -d .whl ]]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl pyzmq msgspec pluggy xxhash safetensors pytest pytest-timeout 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/packages/core/src:$PWD/packages/weight-sync/src${PYTHONPATH:+:$PYTHONPATH}"

# One end of a sender/receiver pair. Announcements travel as msgspec JSON files (written whole, then
# renamed); the receiver copies each version into tensors of its own (as a generator loading weights
# does), says "done", then checks them bit for bit against the same state made again from the seed.
cat > "$WORK/pair.py" <<'PY'
import argparse, json, os, statistics, sys, time
import msgspec, torch
from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync import WeightReceiver, WeightSender

ap = argparse.ArgumentParser()
ap.add_argument("role", choices=["sender", "receiver"])
ap.add_argument("transport")
ap.add_argument("--device", default="cpu")  # where the state lives on both ends
ap.add_argument("--dtype", default="float32")
ap.add_argument("--gib", type=float, default=1.0)
ap.add_argument("--versions", type=int, default=4)  # the first is a warm-up
ap.add_argument("--backend", default="gloo")
ap.add_argument("--port", type=int, default=0)
ap.add_argument("--bucket-mib", type=int, default=256)
ap.add_argument("--dir", required=True)
ap.add_argument("--tag", required=True)
ap.add_argument("--deadline", type=float, default=120.0)  # seconds to wait for the other end, each time
ap.add_argument("--recv-device", default="")  # the receiver's device when not --device (NCCL: another GPU)
a = ap.parse_args()
if a.role == "receiver" and a.recv_device:
    a.device = a.recv_device
DT = getattr(torch, a.dtype)

def state(version):
    g = torch.Generator(device=a.device).manual_seed(version)
    per = int(a.gib * 2**30 / torch.empty(0, dtype=DT).element_size() / 300)
    out = {f"layer{i}.weight": torch.randn(per + i % 7, generator=g, device=a.device).to(DT) for i in range(300)}
    out["odd.vector"] = torch.randn(7919, generator=g, device=a.device).to(DT)  # a prime number of elements
    out["empty.bias"] = torch.empty(0, dtype=DT, device=a.device)
    return out

def wait_for(path):
    t = time.monotonic()
    while not os.path.exists(path):
        if os.path.exists(d("failed")):  # the other end gave up: so do we
            sys.exit(f"{a.tag} {a.role}: the other end failed: {open(d('failed')).read()}")
        if time.monotonic() - t > a.deadline:
            sys.exit(f"{a.tag} {a.role}: nothing at {path} within {a.deadline:.0f} s")
        time.sleep(0.0005)

def put(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)

def sync():
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()

d = lambda name: os.path.join(a.dir, f"{a.tag}.{name}")
opts = {}
if a.transport == "torch_dist":
    opts = {"address": f"127.0.0.1:{a.port}", "world_size": 2, "backend": a.backend, "device": a.device, "timeout_s": 120}
if a.transport == "cuda_ipc" and a.role == "sender":
    opts = {"device": a.device}

def run_sender():
    sender = WeightSender(a.transport, bucket_bytes=a.bucket_mib * 2**20, **opts)
    src = state(1)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    dst = {k: torch.empty_like(t) for k, t in src.items()}
    copies = []
    for _ in range(3):  # the baseline, in the same run: a plain copy of the same bytes on the same device
        sync(); t0 = time.perf_counter()
        for k, t in src.items():
            dst[k].copy_(t)
        sync(); copies.append(time.perf_counter() - t0)
    del dst
    times, stats, ok = [], [], []
    for v in range(1, a.versions + 1):
        st = src if v == 1 else state(v)
        sync()
        t0 = time.perf_counter()
        ann = sender.send(st, v)
        put(d(f"ann{v}"), msgspec.json.encode(ann))
        wait_for(d(f"done{v}"))
        if v > 1:
            times.append(time.perf_counter() - t0)
            stats.append(sender.last_stats)
        wait_for(d(f"ok{v}"))  # the receiver's bit-for-bit check, outside the timing
        ok.append(json.load(open(d(f"ok{v}"))))
    where = sorted({w for o in ok for w in o["where"]})
    sender.close()
    copy_s, e2e = min(copies), statistics.median(times)
    return {"tag": a.tag, "transport": a.transport, "device": a.device, "dtype": a.dtype, "bytes": nbytes,
            "buckets": len(ann.bucket_sizes), "checksum": ann.checksum, "bit_identical": all(o["same"] for o in ok),
            "received_on": where,
            "device_verify": ann.checksum == "mix64-sum" and where == ["cuda"],
            "e2e_s": round(e2e, 4), "GBps": round(nbytes / e2e / 1e9, 2), "copy_s": round(copy_s, 5),
            "vs_copy": round(copy_s / e2e, 4),
            **{k.split("/")[1]: round(statistics.median(s[k] for s in stats), 4)
               for k in ("weights/send_s", "weights/pack_s", "weights/stage_s")}}


def run_receiver():
    if a.transport == "torch_dist":
        opts["rank"] = 1
    receiver = WeightReceiver(a.transport, **opts)
    held = {}
    where = set()

    def apply(tensors):  # into tensors of our own, as a generator loading weights does
        for name, t in tensors:
            where.add(t.device.type)  # torch_dist on CUDA: the buckets stayed on the GPU (device verify)
            if name not in held:
                held[name] = torch.empty(t.shape, dtype=t.dtype, device=a.device)
            held[name].copy_(t)
        sync()

    for v in range(1, a.versions + 1):
        wait_for(d(f"ann{v}"))
        ann = msgspec.json.decode(open(d(f"ann{v}"), "rb").read(), type=WeightsAvailable)
        receiver.receive(ann, apply)
        put(d(f"done{v}"), b"1")
        want = state(v)
        same = set(want) == set(held) and all(
            held[k].dtype == t.dtype and held[k].shape == t.shape
            and torch.equal(held[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            for k, t in want.items())
        put(d(f"ok{v}"), json.dumps({"same": same, "where": sorted(where)}).encode())
    receiver.close()


try:
    if a.role == "sender":
        print(json.dumps(run_sender()))
    else:
        run_receiver()
except BaseException as e:
    put(d("failed"), f"{a.role}: {type(e).__name__}: {e}".encode())
    raise
PY

# The whole check keeps to BUDGET seconds (one device call of ~8 minutes): each step gets at most what
# is left, and is skipped when under 30 s are left.
BUDGET="${WS_BUDGET:-450}"
left() { echo $(( BUDGET - SECONDS )); }
limit() { local l; l=$(left); (( l < $1 )) && echo "$l" || echo "$1"; }

# pair TAG TRANSPORT [pair.py options]: runs a sender and a receiver, each under a time limit; prints
# the sender's JSON line (appended to $JSON) or what went wrong
pair() {
    local tag=$1 transport=$2; shift 2
    local lim port
    lim=$(limit "${PAIR_LIMIT:-150}")
    if (( lim < 30 )); then echo "$tag: skipped (time budget spent)"; return; fi
    port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    timeout "$lim" "$PY" "$WORK/pair.py" receiver "$transport" --dir "$WORK" --tag "$tag" --port "$port" \
        --deadline $((lim - 20)) "$@" > "$WORK/$tag.recv.log" 2>&1 &
    local rpid=$!
    timeout "$lim" "$PY" "$WORK/pair.py" sender "$transport" --dir "$WORK" --tag "$tag" --port "$port" \
        --deadline $((lim - 20)) "$@" > "$WORK/$tag.send.log" 2>&1
    local src=$?
    wait $rpid
    local rrc=$?
    if [[ $src -eq 0 && $rrc -eq 0 ]]; then
        tail -1 "$WORK/$tag.send.log" | tee -a "$JSON"
    else
        echo "$tag: FAILED (sender rc $src, receiver rc $rrc; 124: over its $lim s)"
        cat "$WORK/$tag.failed" 2>/dev/null && echo
        grep -h -m4 -E "Error|WARN|Duplicate" "$WORK/$tag.send.log" "$WORK/$tag.recv.log" | cut -c1-300
        echo "{\"tag\": \"$tag\", \"failed\": true}" >> "$JSON"
    fi
}

HAVE_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

{
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

echo "== 0. the pair driver over host memory (small state; runs without a GPU)"
pair cpu-gloo-fp32 torch_dist --gib 0.05 --dtype float32 --bucket-mib 8
pair cpu-shm-bf16 shm --gib 0.05 --dtype bfloat16 --bucket-mib 8

echo "== a. torch_dist on the GPU, ${GIB} GiB"
if [[ $HAVE_CUDA == 1 ]]; then
    # WS_NCCL_DEVICES=0,1: sender on the first GPU, receiver on the second (NCCL refuses two ranks on one)
    NCCL_DEV=(--device cuda)
    if [[ -n "${WS_NCCL_DEVICES:-}" ]]; then
        NCCL_DEV=(--device "cuda:${WS_NCCL_DEVICES%%,*}" --recv-device "cuda:${WS_NCCL_DEVICES##*,}")
    fi
    NCCL_DEBUG=WARN PAIR_LIMIT=90 pair nccl-fp32 torch_dist "${NCCL_DEV[@]}" --backend nccl --gib "$GIB" --dtype float32
    if grep -q '"tag": "nccl-fp32", "failed"' "$JSON"; then
        echo "nccl-fp32 failed (above). NCCL >= 2.5 refuses two ranks on one GPU ('Duplicate GPU detected'): the NCCL path was NOT checked; it needs 2 GPUs (WS_NCCL_DEVICES=0,1)"
    else
        NCCL_DEBUG=WARN pair nccl-bf16 torch_dist "${NCCL_DEV[@]}" --backend nccl --gib "$GIB" --dtype bfloat16
    fi
    pair gloo-cuda-fp32 torch_dist --device cuda --backend gloo --gib "$GIB" --dtype float32 --versions 3
    pair gloo-cuda-bf16 torch_dist --device cuda --backend gloo --gib "$GIB" --dtype bfloat16 --versions 3
    # the device-verify path: every torch_dist pair on CUDA that ran must report it (mix64-sum, GPU tensors)
    "$PY" - "$JSON" <<'CHECK'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
dist = [r for r in rows if r.get("transport") == "torch_dist" and str(r.get("device", "")).startswith("cuda")]
for r in dist:
    print(f"{r['tag']}: device verify {'YES' if r['device_verify'] else 'NO'} "
          f"(checksum {r['checksum']}, received on {r['received_on']}, bit-identical {r['bit_identical']})")
ran = {r["tag"] for r in dist}
print("NCCL device-verify path:", "checked" if ran & {"nccl-fp32", "nccl-bf16"} else "NOT checked (no NCCL pair ran)")
sys.exit(0 if all(r["device_verify"] and r["bit_identical"] for r in dist) else 1)
CHECK
    echo "device-verify check exit status $? (1: a CUDA torch_dist pair verified on the host or differed)"
else
    echo "needs CUDA: torch_dist over NCCL / with CUDA tensors NOT checked"
fi

echo "== b. cuda_ipc, ${GIB} GiB (vs_copy: a device-to-device copy of the same bytes / end to end)"
if [[ $HAVE_CUDA == 1 ]]; then
    pair ipc-fp32 cuda_ipc --device cuda --gib "$GIB" --dtype float32
    pair ipc-bf16 cuda_ipc --device cuda --gib "$GIB" --dtype bfloat16
    if (( $(left) < 60 )); then
        echo "the package's cuda_ipc tests: skipped (time budget spent)"
    elif "$PY" -c "import pytest" 2>/dev/null; then
        timeout "$(limit 150)" "$PY" -m pytest -p no:cacheprovider -o addopts="" -q -rs packages/weight-sync/tests/test_cuda_ipc.py \
            packages/weight-sync/tests/test_transports.py -k "cuda" 2>&1 | tail -6
    else
        echo "pytest does not import here: the package's cuda_ipc tests were NOT run"
    fi
else
    echo "needs CUDA: cuda_ipc NOT checked"
fi

echo "== c. tools/bench/weight_sync.py"
if (( $(left) < 60 )); then
    echo "bench: skipped (time budget spent)"
else
    timeout "$(limit 200)" "$PY" tools/bench/weight_sync.py --big-gib "$GIB" --small 3000 2>&1 | tail -18
    echo "bench exit status ${PIPESTATUS[0]} (124: over its time limit)"
fi
echo "== done in ${SECONDS} s"
} 2>&1 | tee "$REPORT"
