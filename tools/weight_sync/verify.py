"""Verify a weight sync end to end: trainer steps → sync → the engine serves exactly the new weights.

    python tools/weight_sync/verify.py --model-path runs/quickstart/tiny_model --transport ipc
    torchrun --nproc-per-node 4 tools/weight_sync/verify.py --model-path DIR --tp 2 --pp 2 --transport broadcast
    torchrun --nproc-per-node 2 tools/weight_sync/verify.py --model-path MOE_DIR --ep 2   # experts from each EP rank
    ... --num-engines 2                          # two local engine servers (broadcast: both in each stage's group)
    ... --engine-url http://127.0.0.1:30000      # use running engines (repeat the flag) instead of local engine servers
    ... --engine-device cuda                     # the local engine on the GPU (ipc: CUDA handles, device to device)
    ... --transport ipc --transport broadcast --transport disk   # one sync per transport, in turn, same engines
    ... --delta auto --syncs 2                   # weight_sync.delta: the second sync of each transport is a delta

Builds the Megatron policy (layout --tp × --pp), takes --steps SGD steps on a fixed loss so the
weights move away from the checkpoint, pushes them to the engine with the chosen transport, then
lets every engine sample fixed prompts and compares its behavior logprobs with the trainer's own
logprobs of the same tokens (independent of the bridge's own post-sync probe, whose numbers are
reported too). Prints as its last line one JSON object with `max_abs_logprob_diff`, the engines'
`weight_version`, the probe's `probe_max_abs_logprob_diff`, the sync seconds and bytes. Exit 0 when
the diff ≤ --tol on every engine.

With --transport repeated, the transports take turns on the same engines (one start-up of trainer
and engines instead of one per transport): before each, --steps more steps move the weights, and
the sync's version is --version + its index. Each prints its own JSON line, with
`stale_max_abs_logprob_diff`, the same comparison just before the sync: what the engines served
then was the previous weights, so a transport that delivered nothing would leave its diff that large.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1; MoE with TP needs it)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    p.add_argument("--transport", action="append", choices=["ipc", "broadcast", "disk"],
                   help="ipc (default), broadcast or disk; repeat to sync with each in turn")
    p.add_argument("--engine-url", action="append", default=[])
    p.add_argument("--num-engines", type=int, default=1, help="local engine servers to start (without --engine-url)")
    p.add_argument("--engine-device", default="cpu", help="device of the started engine servers: cpu, cuda, cuda:N")
    p.add_argument("--bucket-mb", type=float, default=0.05, help="small by default so several buckets are used")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--delta", default="off", choices=["off", "on", "auto"],
                   help="weight_sync.delta of the bridge (docs/weight_sync.md 'Delta pushes')")
    p.add_argument("--syncs", type=int, default=1,
                   help="syncs per transport through the same bridge (--steps more steps before each): with "
                        "--delta the second one is a delta push to engines that take them")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.ports import free_ports
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.model_builder import MoEOptions, ScaleOptions
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch
    from megatron_flash.weight_sync.bridge import WeightBridge

    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, tp_size=args.tp, pp_size=args.pp,
                                           micro_batch_size=8, optimizer=OptimizerConfig(name="sgd", lr=0.5),
                                           # EP with the allgather dispatcher trains without the
                                           # load-balancing loss (docs/moe.md)
                                           moe=MoEOptions(ep_size=args.ep, etp_size=args.etp,
                                                          aux_loss_coeff=0.0 if args.ep > 1 else None),
                                           scale=ScaleOptions(sequence_parallel=args.sp)))
    rank0 = dist.get_rank() == 0
    tmp = tempfile.mkdtemp(prefix="mf_verify_") if rank0 else ""
    launcher = None
    urls = list(args.engine_url)
    if rank0 and not urls:
        launcher = EngineLauncher(backend="local", model_path=args.model_path, base_port=free_ports(args.num_engines),
                                  num_engines=args.num_engines, run_dir=tmp, startup_timeout_s=180,
                                  server_args={"device": args.engine_device, "dtype": "float32"})
        launcher.__enter__()
        urls = list(launcher.urls)
    shared = [urls, tmp]
    dist.broadcast_object_list(shared, src=0)
    urls, tmp = shared
    prompts = [[11, 9, 12, 10, 18], [5, 6, 7, 8], [20, 21, 22]]

    def engines_vs_trainer() -> tuple[float, list[str]]:
        """Every engine samples the prompts; the largest |engine − trainer| logprob over the sampled
        tokens (every rank) and the versions the engines reported."""
        samples: list = [None]
        if rank0:
            async def sample(url: str) -> list:
                async with EngineClient(url) as client:
                    return [await client.generate(pr, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True})
                            for pr in prompts]
            samples = [[(pr, r.output_ids, r.output_logprobs, r.weight_version)
                        for url in urls for pr, r in zip(prompts, asyncio.run(sample(url)))]]
        dist.broadcast_object_list(samples, src=0)
        worst = 0.0
        for prompt, out_ids, engine_lp, _ in samples[0]:
            seq = torch.tensor([prompt + out_ids])
            lp, _ = policy.compute_logprobs(TrainBatch(tokens=seq, loss_mask=torch.zeros(seq.shape)))
            trainer_lp = lp[0, len(prompt):]
            worst = max(worst, (trainer_lp.double() - torch.tensor(engine_lp, dtype=torch.float64)).abs().max().item())
        return worst, [s[3] for s in samples[0]]

    code = 0
    try:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(4, policy.spec.vocab_size, (8, 12), generator=gen)
        batch = TrainBatch(tokens=tokens, loss_mask=torch.ones(8, 12))
        transports = args.transport or ["ipc"]
        runs = [(t, k) for t in transports for k in range(args.syncs)]
        bridge = None
        for index, (transport, repeat) in enumerate(runs):
            for _ in range(args.steps):
                policy.train_step(batch, nll_loss_fn)
            stale = engines_vs_trainer()[0] if len(runs) > 1 else None
            version = args.version + index
            if repeat == 0:
                if bridge is not None:
                    bridge.close()  # its buffers or broadcast group; the next transport brings its own
                bridge = WeightBridge(policy, urls, transport=transport, bucket_mb=args.bucket_mb,
                                      disk_dir=os.path.join(tmp, "weights"), fail_fast=True, delta=args.delta)
            report = bridge.sync(version)
            worst, versions = engines_vs_trainer()
            ok = worst <= args.tol
            code = code or (0 if ok else 1)
            if rank0:
                print(json.dumps({"transport": transport, "version": version, "tp": args.tp, "pp": args.pp,
                                  "ep": args.ep, "num_engines": len(urls), "max_abs_logprob_diff": worst,
                                  "stale_max_abs_logprob_diff": stale, "weight_version": versions[0],
                                  "weight_versions": sorted(set(versions)),
                                  "probe_max_abs_logprob_diff": report.max_abs_logprob_diff,
                                  "probe_mean_abs_logprob_diff": report.mean_abs_logprob_diff,
                                  "sync_seconds": round(report.seconds, 3), "probe_seconds": round(report.probe_seconds, 3),
                                  "bytes_sent": report.bytes_sent, "num_buckets": report.num_buckets,
                                  "synced_urls": report.synced_urls, "failed_urls": report.failed_urls,
                                  "ipc_paths": sorted(set(getattr(bridge.transport, "paths", {}).values())),
                                  "modes": report.modes, "delta_density": report.delta_density,
                                  "ok": ok}), flush=True)
    except BaseException:
        code = 1
        raise
    finally:
        if launcher is not None:
            launcher.__exit__(None, None, None)
        destroy_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
