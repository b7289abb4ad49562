#!/usr/bin/env bash
# The GPU checks: the fast paths and measurements that need CUDA, prepared so that one short run does
# them. The machine they were written for has torch with CUDA but none of our other dependencies and no
# network: they come as py3.12
# wheels in .whl/ (ignored by git; copy it to the machine with the working tree).
#
#   bash tools/gpu_checks.sh download            # on a machine with network, once: the wheels into .whl/ (about 30 MB)
#   on the GPU machine, with .whl/ and runs/bench_models copied there, under a time limit ≈ GPU_DEADLINE + 40 s:
#     GPU_DEADLINE=440 bash tools/gpu_checks.sh run weights steps rollout async -- weights_test quickstart contract
# The stages before `--` run one after another (the timing ones); those after it run beside them (the
# correctness ones: they share the GPU and the cores with the timings, which the numbers must say).
# Every stage is cut to end by GPU_DEADLINE seconds; its output is in $OUT/logs.tgz (<stage>.log).
#
# Seconds each took on an H200 (2026-11-26; the install and start-up take ≈ 20 s):
#
#   weights       (65)  tools/weight_sync/bench.py --device cuda at 1 GB: flat persistent buffers (staged) vs
#                       one handle per tensor (fresh), ratio to a D2D copy; the bridge into a GPU engine
#   steps         (100) benchmarks/engine_step_cost.py --device cuda: a ≈0.5B bf16 model (24 × 1024, 152k
#                       vocab) at 1…256 sequences with the engine's per-step split, and the tiny model's curve
#                       (the rollout benchmarks' model: the planner's input for them)
#   rollout       (≈ 360) queue_scheduling.py (195) and prompt_replication.py with --engine-device cuda, one
#                       round each
#   rollout64     (> 270) the same with 64 slots per engine, 8 steps (neither finished in 150 s)
#   profile       benchmarks/cb_step_profile.py on the ≈0.5B model: where transformers CB's step goes
#   ipc_split     the CUDA ipc sync with 256 MB and 1 GB buckets, the receiver's open/copy/sync split
#   async         async_vs_sync.py with --engine-device cuda, one round
#   weights_test  (95)  tests/gpu/test_gpu_weight_sync.py (CUDA ipc into a GPU engine, exact)
#   quickstart    (85)  the README quickstart with trainer and engine on the one GPU (tests/gpu)
#   contract      (230) the contract tier (tests/contract) against the local engine on CUDA
#   contract_broadcast (110) its broadcast weight-sync case alone
#   tier          the whole tests/gpu tier (about 10 min on an H100: best run on its own)
#   trainer       (not run yet; ≈ 7 min planned) flash vs local attention tests (tests/gpu/test_gpu_attention.py),
#                 bf16 parity with transformers (auto = flash there), benchmarks/logprob_memory.py (16k × 152k),
#                 then benchmarks/trainer_throughput.py
#                 --device cuda --preset 0.5b and 1.5b (local vs flash vs bare, mfu, peak memory)
#   engine        (not run yet; ≈ 6.5 min planned) benchmarks/engine_step_cost.py --device cuda --preset 0.5b at
#                 1k-token contexts, k = 1, 8, 64, 256, static decoder and transformers CB side by side; a 1.5b
#                 static row; tools/weight_sync/bench.py --device cuda --engine into the static decoder
#   shared_prefix (not run yet; ≈ 4 min planned) tests/gpu/test_gpu_shared_prefix.py (flash, bf16, shared vs
#                 unshared), then benchmarks/trainer_throughput.py --shared-prefix on the 0.5b preset at
#                 P/R = 8 and 1/8 (n = 8), flash attention
#   context_parallel (not run yet; ≈ 5.5 min planned) tests/gpu/test_gpu_context_parallel.py (the flash plan on
#                 one GPU; CP2 vs CP1 on two), then benchmarks/long_context.py --seq-len 8192,32768 --cp 1,2 in
#                 bf16 (flash; CP2 runs only where two GPUs are)
#   rollout_static (not run yet; ≈ 7 min planned) queue_scheduling.py, prompt_replication.py, async_vs_sync.py
#                 with --engine-device cuda on the static decoder (64 running per engine)
#   delta_sync    (not run yet; ≈ 2.5 min planned) benchmarks/delta_density.py on the ≈0.5B model in CUDA
#                 memory: the delta encoder (bf16 compare, positions, zlib, checksums) in seconds per GB,
#                 and its share of a train step; tools/weight_sync/delta_check.py (checksums on the GPU)
#   The stages of the GPU rows still open, in order: engine, trainer, shared_prefix, rollout_static (each alone):
#     GPU_DEADLINE=440 bash tools/gpu_checks.sh run engine -- contract
#   The newest megatron-core on the GPU (what Python 3.12 users get; CI tests it on CPU only):
#     MCORE_VERSION=0.19.2 bash tools/gpu_checks.sh download   (in a fresh .whl/), then e.g. `run quickstart`
# docs/benchmarks.md says where each number goes.
set -u
cd "$(dirname "$0")/.."

WHEELS="megatron-core==${MCORE_VERSION:-0.16.1} transformers==5.23.0 tokenizers==0.23.3 huggingface_hub==2.4.0 httpx2==2.16.2
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

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit (clipped to the deadline), keep its output
    local name=$1 limit=$2 left
    shift 2
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s left before the deadline"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s) starts at ${SECONDS}s: $*"
    local t0=$SECONDS rc
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s; its last lines:"
    grep -v '^\s*$' "$LOGS/$name.log" | tail -n 4 | cut -c1-1500
}

track() {  # the named stages, one after another
    for name in "$@"; do
        case $name in
            weights_test)  # CUDA ipc into a GPU engine, exact; GPU tensors arrive exactly in another process
                stage weights_test 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_weight_sync.py ;;
            weights)
                for mode in staged fresh; do
                    stage "bench_cuda_$mode" 90 python3 tools/weight_sync/bench.py --device cuda --ipc-mode $mode \
                        --size-mb 1024 --bucket-mb 256 --repeats 5
                done
                stage bench_cuda_engine 150 python3 tools/weight_sync/bench.py --device cuda --engine --size-mb 512 \
                    --bucket-mb 128 --repeats 3 ;;
            steps)
                stage make_05b 90 python3 tools/make_tiny_model.py --out /tmp/m05b --num-layers 24 --hidden-size 1024 \
                    --vocab-size 151936
                stage engine_steps 200 python3 benchmarks/engine_step_cost.py --device cuda --dtype bfloat16 \
                    --model-path /tmp/m05b --k 1,8,64,256 --short 8 --long 40 --repeats 2
                stage engine_steps_tiny 120 python3 benchmarks/engine_step_cost.py --device cuda --dtype bfloat16 \
                    --k 1,4,8,16,32,64 --short 8 --long 40 --repeats 3 ;;
            rollout)  # the long-tail model comes from runs/bench_models (copy it over) or is built here
                stage queue_scheduling 200 python3 benchmarks/queue_scheduling.py --engine-device cuda --rounds 1
                stage prompt_replication 160 python3 benchmarks/prompt_replication.py --engine-device cuda \
                    --rounds 1 --chunk 4 ;;
            rollout64)  # the same with as many slots per engine as a GPU serves at a flat step
                stage queue_scheduling_64 150 python3 benchmarks/queue_scheduling.py --engine-device cuda --rounds 1 \
                    --max-running 64 --steps 8 --skip 2
                stage prompt_replication_64 150 python3 benchmarks/prompt_replication.py --engine-device cuda \
                    --rounds 1 --chunk 4 --max-inflight 64 --steps 8 --skip 2 ;;
            profile)  # where transformers CB's decode step goes on the ≈0.5B model (plain CB; CUDA graphs)
                [ -f /tmp/m05b/config.json ] || stage make_05b 90 python3 tools/make_tiny_model.py --out /tmp/m05b \
                    --num-layers 24 --hidden-size 1024 --vocab-size 151936
                stage cb_profile 120 python3 benchmarks/cb_step_profile.py --model-path /tmp/m05b --device cuda \
                    --k 1,8,64 --graphs ;;
            ipc_split)  # the CUDA ipc sync's parts, 4 buckets of 256 MB and one of 1 GB
                for mb in 256 1024; do
                    stage "bench_cuda_bucket$mb" 60 python3 tools/weight_sync/bench.py --device cuda --ipc-mode staged \
                        --size-mb 1024 --bucket-mb $mb --repeats 5
                done ;;
            contract_broadcast)
                stage contract_broadcast 150 env MF_CONTRACT_BACKENDS=cuda python3 -m pytest -q -p no:cacheprovider \
                    tests/contract/test_weight_sync_sglang.py -k broadcast ;;
            async)
                stage async_vs_sync 240 python3 benchmarks/async_vs_sync.py --engine-device cuda --rounds 1 ;;
            quickstart)  # the README quickstart with trainer and engine on the one GPU
                stage quickstart_one_gpu 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_pipeline.py \
                    -k trainer_and_engine_on_one_gpu ;;
            contract)  # the contract tier against the local engine on CUDA
                stage contract_cuda 400 env MF_CONTRACT_BACKENDS=cuda python3 -m pytest -v -p no:cacheprovider \
                    tests/contract ;;
            tier)
                stage gpu_tier 560 python3 -m pytest -q -s -p no:cacheprovider tests/gpu ;;
            trainer)  # flash attention, MFU, logprob memory: run alone (timings)
                stage attention_test 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_attention.py \
                    "tests/gpu/test_gpu_parity.py::test_parity_one_gpu" -k "bfloat16 or flash or packed or padded"
                stage logprob_memory 60 python3 benchmarks/logprob_memory.py --device cuda
                stage trainer_05b 150 python3 benchmarks/trainer_throughput.py --device cuda --preset 0.5b --rounds 2
                stage trainer_15b 200 python3 benchmarks/trainer_throughput.py --device cuda --preset 1.5b --rounds 1 ;;
            engine)  # the local engine's static decoder vs transformers CB, decode step on CUDA; pushes into it
                stage static_decoder_test 90 python3 -m pytest -q -s -p no:cacheprovider \
                    tests/gpu/test_gpu_static_decoder.py
                stage engine_steps_05b 200 python3 benchmarks/engine_step_cost.py --device cuda --preset 0.5b \
                    --prompt-len 1000 --k 1,8,64,256 --decoder static,cb --short 8 --long 40 --repeats 2
                stage engine_steps_15b 100 python3 benchmarks/engine_step_cost.py --device cuda --preset 1.5b \
                    --prompt-len 1000 --k 1,64,256 --decoder static --short 8 --long 40 --repeats 2
                stage bench_cuda_engine_static 90 python3 tools/weight_sync/bench.py --device cuda --engine \
                    --size-mb 1024 --bucket-mb 256 --repeats 3 --engine-decoder static ;;
            shared_prefix)  # a group's prompt once: exactness of the flash path, then its speed-up
                stage shared_prefix_test 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_shared_prefix.py
                stage shared_prefix_pr8 100 python3 benchmarks/trainer_throughput.py --device cuda --preset 0.5b \
                    --shared-prefix --batch 32 --group-size 8 --prompt-len 2048 --response-len 256 --rounds 2
                stage shared_prefix_pr1_8 100 python3 benchmarks/trainer_throughput.py --device cuda --preset 0.5b \
                    --shared-prefix --batch 32 --group-size 8 --prompt-len 128 --response-len 1024 --rounds 2 ;;
            context_parallel)  # the CP flash plan on one GPU (CP2 trainer vs CP1 on two), then memory and time
                stage cp_test 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_context_parallel.py
                stage cp_long 240 python3 benchmarks/long_context.py --seq-len 8192,32768 --cp 1,2 \
                    --dtype bfloat16 --timeout 110 ;;
            delta_sync)  # the delta encoder on the GPU: cost per GB against the train step; exactness
                [ -f /tmp/m05b/config.json ] || stage make_05b 90 python3 tools/make_tiny_model.py --out /tmp/m05b \
                    --num-layers 24 --hidden-size 1024 --vocab-size 151936
                stage delta_density_05b 120 python3 benchmarks/delta_density.py --hf-dir /tmp/m05b --lrs 1e-5 \
                    --steps 5 --batch 4 --seq-len 128
                stage delta_check 90 python3 tools/weight_sync/delta_check.py --model-path runs/bench_models/sort4_quickstart_s0/warm_model \
                    --pushes 20 --anchor-every 10 --drop-at 5 --corrupt-at 8 ;;
            rollout_static)  # the paper's rollout gains on the static decoder (flat step), one round each
                stage queue_scheduling_static 150 python3 benchmarks/queue_scheduling.py --engine-device cuda \
                    --rounds 1 --max-running 64 --steps 8 --skip 2
                stage prompt_replication_static 120 python3 benchmarks/prompt_replication.py --engine-device cuda \
                    --rounds 1 --chunk 4 --max-inflight 64 --steps 8 --skip 2
                stage async_vs_sync_static 150 python3 benchmarks/async_vs_sync.py --engine-device cuda --rounds 1 ;;
            *)
                echo "unknown stage $name (see the header)" ;;
        esac
    done
}

run() {  # run STAGES... [-- STAGES...]: the second list runs beside the first (correctness beside timing)
    OUT=${OUT:-/tmp/out}
    LOGS=/tmp/gpu_logs
    DEADLINE=${GPU_DEADLINE:-500}  # seconds from here: every stage is cut to end by then
    mkdir -p "$OUT" "$LOGS"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, megatron.core; print(torch.__version__, transformers.__version__)"
    local first=() beside=() into=first
    for a in "$@"; do
        if [ "$a" = "--" ]; then into=beside; elif [ $into = first ]; then first+=("$a"); else beside+=("$a"); fi
    done
    local pid=""
    if [ ${#beside[@]} -gt 0 ]; then
        track "${beside[@]}" > "$LOGS/beside.txt" 2>&1 &
        pid=$!
    fi
    track "${first[@]}"
    [ -n "$pid" ] && wait "$pid" && echo "--- beside:" && cat "$LOGS/beside.txt"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    tar -czf "$OUT/logs.tgz" -C "$LOGS" . && echo "logs: \$OUT/logs.tgz ($(du -h "$OUT/logs.tgz" | cut -f1))"
}

case ${1:-} in
    download) download ;;
    run) shift; run "$@" ;;
    *) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
