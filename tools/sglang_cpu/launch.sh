#!/usr/bin/env bash
# Start the real SGLang 0.5.23 server on CPU from the cached venv made by install.sh.
#
#   tools/sglang_cpu/launch.sh MODEL_DIR PORT [LOG] [-- EXTRA_SGLANG_ARGS...]
#
# Runs in the foreground (exec), so the caller's PID is the server's; the server spawns a scheduler
# and a detokenizer process. Stop the whole tree by killing the process group (tests start it with
# start_new_session=True and killpg). With LOG, stdout+stderr go to that file (appended).
# Env:
#   SGLANG_CPU_VENV   venv to use (default: <repo>/.cache/sglang-venv)
#   MF_SGLANG_SHARING_STRATEGY  torch sharing strategy set in every server process (default file_system)
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 MODEL_DIR PORT [LOG] [-- EXTRA_SGLANG_ARGS...]" >&2
    exit 2
fi
MODEL_DIR=$1
PORT=$2
shift 2
LOG=""
if [[ $# -gt 0 && $1 != "--" ]]; then
    LOG=$1
    shift
fi
if [[ $# -gt 0 && $1 == "--" ]]; then
    shift
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${SGLANG_CPU_VENV:-$REPO/.cache/sglang-venv}
if [[ ! -x $VENV/bin/python ]]; then
    echo "SGLang CPU venv not found at $VENV: run tools/sglang_cpu/install.sh first" >&2
    exit 3
fi

# stubs/: the sgl_kernel import stub; site/: sitecustomize.py (torch sharing strategy "file_system").
export PYTHONPATH="$HERE/stubs:$HERE/site${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_USE_CPU_ENGINE=1
# Keep the server off the network and quiet about telemetry-ish things.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1

ARGS=(
    -m sglang.launch_server
    --model-path "$MODEL_DIR"
    --port "$PORT"
    --host 127.0.0.1
    --device cpu
    --attention-backend torch_native
    --sampling-backend pytorch
    --dtype float32
    --max-total-tokens 4096
    --max-running-requests 64
    --disable-cuda-graph
    --skip-server-warmup
    --random-seed 0
    "$@"
)

if [[ -n $LOG ]]; then
    mkdir -p "$(dirname "$LOG")"
    exec "$VENV/bin/python" "${ARGS[@]}" >>"$LOG" 2>&1
else
    exec "$VENV/bin/python" "${ARGS[@]}"
fi
