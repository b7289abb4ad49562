#!/usr/bin/env bash
# Build (or reuse) the cached virtualenv that runs the real SGLang 0.5.23 server on CPU.
#
#   tools/sglang_cpu/install.sh            # idempotent: a no-op when the stamp matches
#   tools/sglang_cpu/install.sh --force    # rebuild from scratch
#
# Result: <repo>/.cache/sglang-venv (override with SGLANG_CPU_VENV), Python 3.11 (override with
# SGLANG_CPU_PYTHON), containing
#   torch==2.13.0 (the CPU wheel; the script refuses a CUDA build), sglang==0.5.23 (--no-deps),
#   torchvision==0.28.0 (--no-deps) with its op-registration imports made non-fatal by
#   patch_torchvision.py (an in-place edit of the installed torchvision/__init__.py, see that file),
#   and the exact dependency set in requirements.txt (installed with --no-deps: no resolver runs,
#   so nothing can drag in a CUDA torch).
# The sgl_kernel stub and the sitecustomize are NOT copied into the venv: launch.sh puts
# tools/sglang_cpu/stubs and tools/sglang_cpu/site on PYTHONPATH.
# The stamp (.mf-sglang-stamp in the venv) is a hash of requirements.txt, this script and the patch;
# when it matches, nothing is done. Measured on the 2-core box: ~4 min from scratch, ~3.1 GB.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${SGLANG_CPU_VENV:-$REPO/.cache/sglang-venv}
PY=${SGLANG_CPU_PYTHON:-python3.11}
STAMP=$VENV/.mf-sglang-stamp
TORCH_PIN=torch==2.13.0
TORCHVISION_PIN=torchvision==0.28.0
SGLANG_PIN=sglang==0.5.23

want=$(cat "$HERE/requirements.txt" "$HERE/install.sh" "$HERE/patch_torchvision.py" | sha256sum | cut -d' ' -f1)

if [[ ${1:-} != "--force" && -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/python ]]; then
    echo "sglang_cpu: $VENV is up to date (stamp $want)"
    exit 0
fi

t0=$(date +%s)
echo "sglang_cpu: building $VENV with $($PY --version 2>&1)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1. CPU torch first, alone (the local wheel store provides 2.13.0+cpu).
"${PIP[@]}" install -q "$TORCH_PIN"
"$VENV/bin/python" -W ignore - <<'PYEOF'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"sglang_cpu: got a CUDA torch build ({torch.__version__}); expected the CPU wheel")
print(f"sglang_cpu: torch {torch.__version__} (CPU)")
PYEOF

# 2. sglang and torchvision without their dependency lists (sglang's names CUDA-only packages).
"${PIP[@]}" install -q --no-deps "$SGLANG_PIN" "$TORCHVISION_PIN"

# 3. The exact CPU-path dependency set.
"${PIP[@]}" install -q --no-deps -r "$HERE/requirements.txt"

# 4. torchvision: op registrations must not raise on CPU torch.
"$VENV/bin/python" "$HERE/patch_torchvision.py" "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# 5. Smoke test: the server's module tree imports with the stub on the path.
PYTHONPATH="$HERE/stubs:$HERE/site" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c '
import torch, torchvision, soundfile, sgl_kernel
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
assert torch.multiprocessing.get_sharing_strategy() == "file_system"
print("sglang_cpu: import smoke test ok")
'

echo "$want" > "$STAMP"
t1=$(date +%s)
echo "sglang_cpu: done in $((t1 - t0)) s; venv size $(du -sh "$VENV" | cut -f1)"
