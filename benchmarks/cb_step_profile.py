"""Where a transformers continuous-batching decode step spends its time (the local engine's generator).

    python benchmarks/cb_step_profile.py --model-path M --device cuda --k 1,8,64 [--graphs]

transformers' CB alone (no engine, no HTTP, its own greedy sampling), configured as the local engine
configures it (engines/local_engine.py: paged cache of --page-size blocks, no block sharing, no async
batching, no CUDA graphs) or, with `--graphs`, also with CUDA graphs and asynchronous batching on.
For each k: k requests of a 4-token prompt decode exactly L tokens (no eos), L = --short and --long;
step(k) = (T(long) − T(short)) / (long − short), the median of --repeats. Then one run at the largest
k under torch.profiler and cProfile:

  gpu_busy_per_step_s   device kernel time per decode step (sum over kernels / steps): a step much
                        longer than this is host-bound (kernel launches, Python, synchronizations)
  syncs_per_step        host↔device synchronizations per step (cudaStreamSynchronize,
                        cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy* with a host side)
  launches_per_step     kernel launches per step
  top_ops               torch ops by self CPU time per step (every thread: CB generates in its own)
  top_lines             where the other threads are, sampled every 0.5 ms: the fraction of samples at
                        each line (a thread waiting for the GPU shows at the line that waits)
  top_functions         the fraction of samples with each function on the stack

Last line: one JSON object with all of it per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")
PROMPT = [1, 2, 3, 4]


def new_manager(model, args, graphs: bool, k: int):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = k * (-(-(len(PROMPT) + args.long + 1) // args.page_size) + 1)
    cb = ContinuousBatchingConfig(num_blocks=blocks, page_size=args.page_size, max_batch_tokens=max(256, k),
                                  allow_block_sharing=False, use_async_batching=graphs, use_cuda_graph=graphs,
                                  return_logprobs=False)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=args.long)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    return manager


def run_batch(manager, k: int, length: int) -> float:
    started = time.perf_counter()
    ids = manager.add_requests(inputs=[list(PROMPT) for _ in range(k)], max_new_tokens=length)
    pending = set(ids)
    while pending:
        result = manager.get_result(timeout=60)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the CB generation thread stopped")
            continue
        if result.is_finished():
            if len(result.generated_tokens) != length:
                raise RuntimeError(f"request {result.request_id}: {len(result.generated_tokens)} tokens, "
                                   f"expected {length} (an eos?)")
            pending.discard(result.request_id)
    return time.perf_counter() - started


class StackSampler:
    """A sampling profiler for the thread with `only` on its stack (CB's generation thread): every
    `interval` seconds its innermost frame counts once for its line ("self") and once for every function
    on its stack ("inclusive"). Wall time, so a thread waiting for the GPU shows at the
    line that waits."""

    def __init__(self, only: str = "continuous_api.py:_run_generation_loop", interval: float = 0.0005) -> None:
        import threading

        self.only, self.interval, self.samples = only, interval, 0
        self.own: dict[str, int] = {}
        self.inclusive: dict[str, int] = {}
        self._stop = threading.Event()
        self._skip = {threading.get_ident()}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        self._skip.add(self._thread.ident)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident in self._skip:
                    continue
                code = frame.f_code
                key = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}"
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    seen.add(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    frame = frame.f_back
                if self.only not in seen:
                    continue
                self.samples += 1
                self.own[key] = self.own.get(key, 0) + 1
                for name in seen:
                    self.inclusive[name] = self.inclusive.get(name, 0) + 1

    def top(self, table: dict[str, int], n: int) -> list:
        total = max(1, self.samples)
        return [[name, round(c / total, 4)] for name, c in sorted(table.items(), key=lambda kv: -kv[1])[:n]]


def profile_run(manager, k: int, length: int, device) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # CB runs its ops in its own thread
        from torch._C._profiler import _ExperimentalConfig

        extra = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        extra = {}
    with StackSampler() as sampler, profile(activities=activities, **extra) as prof:
        seconds = run_batch(manager, k, length)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    on_device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    gpu_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in on_device)
    count = {e.key: e.count for e in events}
    syncs = sum(c for name, c in count.items() if name in SYNC_NAMES)
    launches = sum(c for name, c in count.items() if name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    cpu_ops = sorted((e for e in events if e not in on_device), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "k": k, "tokens": length, "seconds": round(seconds, 4), "seconds_per_step": round(seconds / length, 5),
        "gpu_busy_per_step_s": round(gpu_us / 1e6 / length, 6),
        "syncs_per_step": round(syncs / length, 2), "launches_per_step": round(launches / length, 1),
        "top_ops": [[e.key, round(e.self_cpu_time_total / 1e6 / length, 6), round(e.count / length, 2)]
                    for e in cpu_ops[:15]],
        "samples": sampler.samples,
        "top_lines": sampler.top(sampler.own, 20),
        "top_functions": sampler.top(sampler.inclusive, 25),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", default="1,8,64")
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--graphs", action="store_true", help="also the variant with CUDA graphs + async batching")
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_flash.engines.local_engine import engine_device, engine_dtype

    device = engine_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=engine_dtype(args.dtype)).to(device).eval()
    ks = [int(x) for x in args.k.split(",")]
    result: dict = {"model": args.model_path, "device": str(device), "dtype": args.dtype,
                    "torch": torch.__version__, "python": sys.version.split()[0]}
    for variant in ["engine"] + (["graphs"] if args.graphs else []):
        manager = new_manager(model, args, variant == "graphs", max(ks))
        try:
            result[variant] = {"error": "did not finish"}
            run_batch(manager, max(ks), args.short)  # warm-up (and graph capture)
            steps = {}
            for k in ks:
                t = {length: statistics.median(run_batch(manager, k, length) for _ in range(args.repeats))
                     for length in (args.short, args.long)}
                steps[str(k)] = round((t[args.long] - t[args.short]) / (args.long - args.short), 6)
                print(f"{variant}: k={k:4d} step {1e3 * steps[str(k)]:.2f} ms", flush=True)
            prof = profile_run(manager, max(ks), args.long, device)
            print(f"{variant}: profiled k={max(ks)}: {1e3 * prof['seconds_per_step']:.2f} ms per step, device busy "
                  f"{1e3 * prof['gpu_busy_per_step_s']:.2f} ms, {prof['syncs_per_step']} syncs and "
                  f"{prof['launches_per_step']} launches per step", flush=True)
            result[variant] = {"step_s": steps, "profile": prof}
        except Exception as error:  # one variant failing (graphs where CB cannot capture) leaves the others
            result[variant] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{variant}: failed: {error}", flush=True)
        finally:
            manager.stop(block=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
