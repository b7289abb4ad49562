"""Bytes and seconds per weight push: LoRA adapters by name vs the merged model vs full fine-tuning.

    OMP_NUM_THREADS=1 python benchmarks/lora_sync.py --model runs/quickstart/warm_model --rank 8
    OMP_NUM_THREADS=1 python benchmarks/lora_sync.py --model runs/smollm2 --rank 8 --pushes 5

One local engine (`--enable-lora`) per mode on the model (an adapter push assumes the engine holds the
trainer's base, which a full or merged push replaces); one trainer process (TP1) pushes --pushes times
in each mode, side by side in one run, modes interleaved round by round (full, merged, adapter, full, …):

  full      no adapters: every weight, as a plain run pushes (weight_sync.transport)
  merged    LoRA rank --rank on every target: W + s·B·A formed in float32, a full-weight push
  adapter   the same adapters alone, by name (/load_lora_adapter_from_tensors; disk: /load_lora_adapter)

Before each push every trained tensor moves a little (a fake optimizer step), so every push carries new
values. A push is timed from the bridge's call to its return: pause → transfer → version → resume
(`seconds`), without the post-sync probe, which is timed apart (`probe_seconds`: it checks the engine
serves the trainer's weights, |Δ logprob| ≤ 1e-4 asserted for every push). Reported per mode: bytes per
push, median seconds, and the ratios adapter/merged. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--transport", default="ipc", choices=["ipc", "disk"])
    p.add_argument("--run-dir", default="runs/bench_lora_sync")
    args = p.parse_args()

    import torch

    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.ports import free_ports
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.lora import LoraOptions
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.weight_sync.bridge import WeightBridge

    run_dir = os.path.join(REPO, args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    results: dict[str, dict] = {}
    with EngineLauncher(backend="local", model_path=args.model, base_port=free_ports(3), num_engines=3,
                        run_dir=run_dir, startup_timeout_s=300, server_args={"enable-lora": True}) as launcher:
        urls = dict(zip(("full", "merged", "adapter"), launcher.urls))
        policies = {"full": MegatronPolicy(PolicySettings(hf_path=args.model))}
        # one process group for both policies: the LoRA one is built second and owns it from then on
        lora = MegatronPolicy(PolicySettings(hf_path=args.model, lora=LoraOptions(rank=args.rank)))
        policies["merged"] = policies["adapter"] = lora
        bridges = {mode: WeightBridge(policy, [urls[mode]], transport=args.transport, probe=False,
                                      lora="" if mode == "full" else mode, disk_dir=os.path.join(run_dir, "disk"))
                   for mode, policy in policies.items()}
        version = 0
        times: dict[str, list[float]] = {m: [] for m in bridges}
        probes: dict[str, list[float]] = {m: [] for m in bridges}
        sent: dict[str, int] = {}
        for _ in range(args.pushes):
            for mode, bridge in bridges.items():
                with torch.no_grad():  # new values in every trained tensor
                    for param in policies[mode].chunks[0].parameters():
                        if param.requires_grad:
                            param.add_(1e-3)
                version += 1
                report = bridge.sync(version)
                times[mode].append(report.seconds)
                sent[mode] = report.bytes_sent
                t0 = time.perf_counter()
                worst, mean, _, lost = bridge.probe([urls[mode]])
                probes[mode].append(time.perf_counter() - t0)
                assert not lost and worst <= 1e-4, (mode, worst, lost)
        for mode in bridges:
            results[mode] = {"bytes": sent[mode], "median_s": round(statistics.median(times[mode]), 4),
                             "min_s": round(min(times[mode]), 4), "probe_median_s": round(statistics.median(probes[mode]), 4)}
        for bridge in {id(b): b for b in bridges.values()}.values():
            bridge.close()
        destroy_distributed()
    out = {"model": args.model, "rank": args.rank, "pushes": args.pushes, "transport": args.transport,
           "modes": results,
           "adapter_over_merged_bytes": round(results["adapter"]["bytes"] / results["merged"]["bytes"], 5),
           "adapter_over_merged_seconds": round(results["adapter"]["median_s"] / results["merged"]["median_s"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
