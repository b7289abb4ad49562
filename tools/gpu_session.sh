#!/usr/bin/env bash
# The GPU checks a session runs when it is lent a GPU machine (the `device` tool), prepared so that one
# short call does them. That machine has torch with CUDA but none of our other dependencies and no
# network: they travel as py3.12 wheels in .whl/ (ignored by git, named in the call's `carry`).
#
#   bash tools/gpu_session.sh download            # here, once: the wheels into .whl/ (about 30 MB)
#   device run, carry [".whl"], timeout_s 560:
#     bash tools/gpu_session.sh run weights steps  # on the GPU machine: install, then the chosen stages
#
# Stages (each under its own time limit, every output line also in $OUT/<stage>.log):
#   weights  tests/gpu/test_gpu_weight_sync.py (CUDA ipc into a GPU engine, exact), then
#            tools/weight_sync/bench.py --device cuda at 1 GB: flat persistent buffers vs one handle per
#            tensor, and the bridge into a local engine on the GPU            (about 2.5 min)
#   steps    benchmarks/engine_step_cost.py --device cuda on a ≈0.5B bf16 model (24 × 1024, 152k vocab):
#            decode step at 1…256 sequences with the engine's per-step split  (about 2 min)
#   rollout  benchmarks/queue_scheduling.py and prompt_replication.py with --engine-device cuda, one
#            round each (their tiny long-tail model: the engine's step is then mostly fixed cost)
#   tier     the whole tests/gpu tier                                          (about 5 min)
# docs/benchmarks.md says where each number goes.
set -u
cd "$(dirname "$0")/.."

WHEELS="megatron-core==0.16.1 transformers==5.23.0 tokenizers==0.23.3 huggingface_hub==2.4.0 httpx2==2.16.2
httpcore2==2.16.2 truststore==0.10.5 idna==3.20 anyio==4.16.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 math-verify==0.9.0
latex2sympy2_extended==1.11.0 opentelemetry-api==1.45.2 click==8.5.1 regex==2026.11.15 hf-xet==1.8.0
datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"

download() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    local platforms=""
    for n in 17 24 28 31 34; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms --platform manylinux2014_x86_64 --platform any -d .whl $WHEELS
    ls .whl | wc -l
    du -sh .whl
}

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit, keep its output, never stop the others
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > >(tee -a "$OUT/$name.log") 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0)) s"
}

run() {
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, megatron.core; print(torch.__version__, transformers.__version__)"
    for name in "$@"; do
        case $name in
            weights)
                stage weights_test 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_weight_sync.py
                for mode in staged fresh; do
                    stage "bench_cuda_$mode" 90 python3 tools/weight_sync/bench.py --device cuda --ipc-mode $mode \
                        --size-mb 1024 --bucket-mb 256 --repeats 5
                done
                stage bench_cuda_engine 150 python3 tools/weight_sync/bench.py --device cuda --engine --size-mb 512 \
                    --bucket-mb 128 --repeats 3 ;;
            steps)
                python3 tools/make_tiny_model.py --out /tmp/m05b --num-layers 24 --hidden-size 1024 \
                    --vocab-size 151936 > /dev/null
                stage engine_steps 200 python3 benchmarks/engine_step_cost.py --device cuda --dtype bfloat16 \
                    --model-path /tmp/m05b --k 1,8,64,256 --short 8 --long 40 --repeats 2 ;;
            rollout)
                stage queue_scheduling 240 python3 benchmarks/queue_scheduling.py --engine-device cuda --rounds 1
                stage prompt_replication 240 python3 benchmarks/prompt_replication.py --engine-device cuda \
                    --rounds 1 ;;
            tier)
                stage gpu_tier 330 python3 -m pytest -q -s -p no:cacheprovider tests/gpu ;;
            *)
                echo "unknown stage $name (weights, steps, rollout, tier)"; exit 2 ;;
        esac
    done
}

case ${1:-} in
    download) download ;;
    run) shift; run "$@" ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
esac
