"""Delta weight sync, end to end: many pushes with deltas, anchors and faults, every engine tensor checked.

    python tools/weight_sync/delta_check.py --model-path runs/quickstart/tiny_model --pushes 100
    python tools/weight_sync/delta_check.py --model-path DIR --transport broadcast --transport disk

A one-process Megatron policy (fp32, Adam at --lr) pushes to --num-engines local engine servers that
serve --engine-dtype (bf16 by default), through WeightBridge with weight_sync.delta on. Each push is
one optimizer step on a fixed batch. Faults on engine 1, at the pushes given:

    --restart-at      killed and restarted by its launcher; the bridge is told (readmit): a full push
    --silent-restart-at  killed and restarted behind the bridge's back: it refuses the delta
                      (another base version) and the re-sync sends it everything
    --drop-at         the delta parts of one request never reach it: the final call finds checksums
                      missing (engines/weight_delta.py FAULT_ENV: the engine drops them itself)
    --corrupt-at      one request's delta parts reach it with a bit flipped: a checksum mismatch

After every push each engine's checksum of every tensor (GET /get_weights_by_name with checksum) must
equal the checksum of the trainer's weights cast to the engine dtype (computed here from the trainer's
HF tensors, not from the bridge's kept copy); every --compare-every pushes and after the last, the
values themselves are compared bit for bit. With several --transport the pushes are split into one
block per transport, in turn (one bridge each, same engines: a new bridge starts with a full push). The last stdout line is one
JSON object; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--transport", action="append", choices=["ipc", "broadcast", "disk"])
    p.add_argument("--num-engines", type=int, default=2)
    p.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--pushes", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--anchor-every", type=int, default=25)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    p.add_argument("--restart-at", type=int, action="append", default=[])
    p.add_argument("--silent-restart-at", type=int, action="append", default=[])
    p.add_argument("--drop-at", type=int, action="append", default=[])
    p.add_argument("--corrupt-at", type=int, action="append", default=[])
    p.add_argument("--compare-every", type=int, default=10)
    p.add_argument("--probe", action="store_true", help="the bridge's post-sync logprob probe on every push")
    args = p.parse_args()

    import torch

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.engines.weight_delta import FAULT_ENV, checksum
    from megatron_flash.hf.io import stage_hf_tensors
    from megatron_flash.ports import free_ports
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch
    from megatron_flash.weight_sync.bridge import WeightBridge

    dtype = getattr(torch, args.engine_dtype)
    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, micro_batch_size=8,
                                           optimizer=OptimizerConfig(name="adam", lr=args.lr)))
    tmp = tempfile.mkdtemp(prefix="mf_delta_check_", dir=os.environ.get("MF_WORK_DIR") or None)
    fault_dir = os.environ[FAULT_ENV] = os.path.join(tmp, "faults")  # the engines inherit it
    os.makedirs(fault_dir)
    launcher = EngineLauncher(backend="local", model_path=args.model_path, base_port=free_ports(args.num_engines),
                              num_engines=args.num_engines, run_dir=tmp, startup_timeout_s=180,
                              server_args={"dtype": args.engine_dtype})
    launcher.__enter__()
    launcher.supervise(max_restarts=len(args.restart_at) + len(args.silent_restart_at))
    urls = list(launcher.urls)
    victim = urls[min(1, len(urls) - 1)]

    async def engine_weights(url: str, names: list[str], values: bool) -> dict:
        async with EngineClient(url) as client:
            out = {}
            for name in names:
                body = {"name": name, "checksum": True, "truncate_size": 2**62 if values else 0}
                out[name] = await client._call("POST", "/get_weights_by_name", body=body, timeout_s=60)
            return out

    def check(version: int, values: bool) -> list[str]:
        """Every engine against the trainer's HF tensors cast to the engine dtype: what differs."""
        expected = {n: t.detach().to(dtype) for n, t in stage_hf_tensors(policy.model, spec=policy.spec,
                                                                          layout=policy.layout)}
        problems = []
        for url in urls:
            got = asyncio.run(engine_weights(url, list(expected), values))
            for name, tensor in expected.items():
                if got[name]["checksum"] != checksum(tensor).tolist():
                    problems.append(f"v{version} {url} {name}: checksum")
                if values and got[name]["values"] != tensor.float().reshape(-1).tolist():
                    problems.append(f"v{version} {url} {name}: values")
        return problems

    def restart(url: str) -> None:
        """Kill the engine's process; its launcher starts it again; wait until it is back."""
        index = urls.index(url)
        os.kill(launcher.pids[index], 9)
        deadline = time.monotonic() + 180
        while url not in launcher.take_restarted():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come back")
            time.sleep(0.2)

    transports = args.transport or ["ipc"]
    bridges = {t: WeightBridge(policy, urls, transport=t, bucket_mb=args.bucket_mb, delta="on",
                               engine_dtype=args.engine_dtype, delta_anchor_every=args.anchor_every,
                               disk_dir=os.path.join(tmp, "weights"), probe=args.probe, fail_fast=True)
               for t in transports}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, policy.spec.vocab_size, (8, 16), generator=gen)
    batch = TrainBatch(tokens=tokens, loss_mask=torch.ones(8, 16))
    rows, problems = [], []
    code = 0
    try:
        for version in range(args.pushes + 1):
            transport = transports[min(len(transports) - 1, version * len(transports) // (args.pushes + 1))]
            bridge = bridges[transport]
            if version:
                policy.train_step(batch, nll_loss_fn)
            if version in args.restart_at or version in args.silent_restart_at:
                restart(victim)
                if version in args.restart_at:
                    bridge.readmit([victim])
            fault = "drop" if version in args.drop_at else "corrupt" if version in args.corrupt_at else ""
            if fault:  # the victim loses (or gets a flipped bit in) the delta parts of one request
                with open(os.path.join(fault_dir, str(launcher.pids[urls.index(victim)])), "w") as f:
                    f.write(fault)
            report = bridge.sync(version)
            values = version % args.compare_every == 0 or version == args.pushes
            bad = check(version, values)
            problems += bad
            rows.append({"version": version, "transport": transport, "modes": report.modes, "anchor": report.anchor,
                         "bytes": report.bytes_sent, "bytes_full": report.bytes_full,
                         "density": report.delta_density, "checksum_failures": report.checksum_failures,
                         "delta_refused": report.delta_refused, "resynced": report.resynced_urls,
                         "errors": {u: m[-300:] for u, m in report.errors.items()},
                         "seconds": round(report.seconds, 4), "encode_seconds": round(report.encode_seconds, 4),
                         "fault": fault or ("restart" if version in args.restart_at else
                                            "silent_restart" if version in args.silent_restart_at else ""),
                         "values_compared": values, "problems": len(bad)})
            print(json.dumps(rows[-1]), flush=True)
    except BaseException:
        code = 1
        raise
    finally:
        for bridge in bridges.values():
            bridge.close()
        launcher.__exit__(None, None, None)
        destroy_distributed()
    deltas = [r for r in rows if r["modes"].get("delta")]
    summary = {
        "pushes": len(rows), "transports": transports, "engine_dtype": args.engine_dtype, "lr": args.lr,
        "problems": problems[:20], "num_problems": len(problems),
        "delta_pushes": len(deltas), "anchors": sum(r["anchor"] for r in rows),
        "checksum_failures": sum(r["checksum_failures"] for r in rows),
        "delta_refused": sum(r["delta_refused"] for r in rows),
        "resyncs": sum(len(r["resynced"]) for r in rows),
        "values_compared": sum(r["values_compared"] for r in rows),
        "mean_density": sum(r["density"] for r in deltas) / len(deltas) if deltas else None,
        "delta_bytes_ratio": (sum(r["bytes"] for r in deltas) / sum(r["bytes_full"] for r in deltas)) if deltas else None,
        "copy_bytes": bridges[transports[0]].delta.encoder.copy_bytes(),
        "faults": {r["version"]: r["fault"] for r in rows if r["fault"]},
    }
    print(json.dumps(summary), flush=True)
    return code or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
