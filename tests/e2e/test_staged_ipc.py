"""Staged ipc against a real local engine server when the *trainer* dies mid-sync.

The engine is started here (it must outlive the trainer). Trainer 1 syncs v1 in buffers of 4 KB (the
tiny Llama's tensors go in pieces, sizes are no multiple of the buffer), checks that the engine serves
its weights exactly, trains a step and SIGKILLs itself after bucket 1 of the v2 sync. Then: the engine
still answers at v1, holds exactly the dead trainer's two buffers, and nothing is left in /dev/shm.
Trainer 2 (other weights) syncs v5 — the engine's half-open session from trainer 1 is closed by the
re-sync — and the engine serves trainer 2's weights exactly, having swapped the old buffer set for the
new one (two mappings, not four); a second engine served in bf16 (`--dtype bfloat16`) takes the same
fp32 buffers and casts on copy. Trainer 2 closes its bridge: no buffer descriptor left open.
Wall time ≈ 35 s (two trainer processes).

"Exactly" = the engine's behaviour logprobs equal the trainer's logprobs of the same tokens (≤ 1e-4, fp32).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.conftest import memfd_links, run_tool  # noqa: E402

SCRIPT = os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def memfd_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:mf-weights" in line for line in f)


@pytest.mark.serial  # compares /dev/shm before and after: another test's files there would show up
def test_trainer_killed_mid_sync_leaves_the_engine_serving_and_nothing_behind(tiny_models, tmp_path) -> None:
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.ports import free_ports

    shm_before = set(os.listdir("/dev/shm"))
    with EngineLauncher(backend="local", model_path=tiny_models["llama"], base_port=free_ports(1),
                        run_dir=str(tmp_path), startup_timeout_s=180) as launcher, \
            EngineLauncher(backend="local", model_path=tiny_models["llama"], base_port=free_ports(1),
                           run_dir=str(tmp_path / "bf16"), startup_timeout_s=180,
                           server_args={"dtype": "bfloat16"}) as bf16:
        url, pid = launcher.urls[0], launcher.pids[0]
        args = [SCRIPT, "--model-path", tiny_models["llama"], "--url", url]
        died = run_tool(args + ["--phase", "die"], check=False, timeout=300)
        assert died.returncode == -9, died.stderr[-3000:]
        first = json.loads(died.stdout.strip().splitlines()[-1])
        assert first["v1"] == {"version": "1", "ok": True}, first
        assert first["requests_per_sync"] > 2 * first["num_tensors"]  # 4 KB buffers: tensors in pieces

        async def version() -> str:
            async with EngineClient(url, max_retries=0) as client:
                return await client.get_weight_version()

        assert asyncio.run(version()) == "1"  # the partial v2 never advanced it
        assert memfd_mappings(pid) == 2       # the dead trainer's set, mapped once, nothing more
        assert set(os.listdir("/dev/shm")) == shm_before

        second = json.loads(run_tool(args + ["--phase", "recover", "--bf16-url", bf16.urls[0]],
                                     timeout=300).stdout.strip().splitlines()[-1])
        assert second["v5"] == {"version": "5", "ok": True}, second
        # a bf16 engine gets the same fp32 buffers and casts on copy: its sampling logprobs are the
        # trainer's within bf16 rounding, and far from what it served before the sync
        assert second["bf16_info"] == {"device": "cpu", "dtype": "bfloat16"}, second
        assert second["bf16_v5"]["version"] == "5" and second["bf16_v5"]["max_diff"] < 0.1, second
        assert second["bf16_before"]["max_diff"] > 0.3, second
        assert memfd_mappings(bf16.pids[0]) == 2
        assert second["resynced"] is True  # trainer 1's open session made the first pass fail
        # two buffers, each held by its descriptor and by the mmap's own duplicate
        assert second["memfds_open"] == 4 and second["memfds_after_close"] == 0, second
        assert memfd_mappings(pid) == 2  # the old set was dropped when the new one arrived
        assert asyncio.run(version()) == "5"
    assert set(os.listdir("/dev/shm")) == shm_before


# ---------------------------------------------------------------------------------------------- the trainer
def _main() -> int:
    import argparse
    import signal
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--phase", choices=["die", "recover"], required=True)
    p.add_argument("--bf16-url", default="")
    args = p.parse_args()

    import torch

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch
    from megatron_flash.weight_sync.bridge import WeightBridge
    from megatron_flash.weight_sync.plan import hf_buckets

    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, micro_batch_size=8,
                                           optimizer=OptimizerConfig(name="sgd", lr=0.5)))

    def step(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(4, policy.spec.vocab_size, (8, 12), generator=gen)
        policy.train_step(TrainBatch(tokens=tokens, loss_mask=torch.ones(8, 12)), nll_loss_fn)

    def serves(url: str = "", tolerance: float = 1e-4) -> dict:
        prompts = [[11, 9, 12, 10, 18], [5, 6, 7, 8]]

        async def sample() -> list:
            async with EngineClient(url or args.url) as client:
                return [await client.generate(pr, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True})
                        for pr in prompts]
        worst, version = 0.0, None
        for prompt, r in zip(prompts, asyncio.run(sample())):
            seq = torch.tensor([prompt + r.output_ids])
            lp, _ = policy.compute_logprobs(TrainBatch(tokens=seq, loss_mask=torch.zeros(seq.shape)))
            engine = torch.tensor(r.output_logprobs, dtype=torch.float64)
            worst = max(worst, (lp[0, len(prompt):].double() - engine).abs().max().item())
            version = r.weight_version
        if url:
            return {"version": version, "max_diff": worst}
        return {"version": version, "ok": worst <= tolerance}

    def memfds() -> int:
        return len(memfd_links())

    requests: list = []
    dying = [False]

    def on_bucket(index: int) -> None:
        if dying[0] and index == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    out: dict = {}
    try:
        bridge = WeightBridge(policy, [args.url], transport="ipc", bucket_mb=0.004, timeout_s=30, on_bucket=on_bucket)
        deliver = bridge.transport._deliver

        def counting(spec: dict, entries: list, urls: list, label: str) -> dict:
            requests.append(len(entries))
            return deliver(spec, entries, urls, label)
        bridge.transport._deliver = counting
        if args.phase == "die":
            step(0)
            bridge.sync(1)
            num_tensors = sum(len(b) for b in hf_buckets(policy, bucket_bytes=1 << 62, copy=False))
            out.update(v1=serves(), requests_per_sync=len(requests), num_tensors=num_tensors)
            print(json.dumps(out), flush=True)
            step(1)
            dying[0] = True
            bridge.sync(2)
            raise AssertionError("the trainer should have been killed during the v2 sync")
        step(2)
        step(3)
        out["bf16_before"] = serves(args.bf16_url)
        bridge.readmit([args.bf16_url])  # a second engine, served in bf16
        report = bridge.sync(5)

        async def info() -> dict:
            async with EngineClient(args.bf16_url) as client:
                got = await client.server_info()
            return {"device": got["device"], "dtype": got["dtype"]}
        out.update(v5=serves(), resynced=report.resynced_urls == [args.url], memfds_open=memfds(),
                   bf16_v5=serves(args.bf16_url), bf16_info=asyncio.run(info()))
        bridge.close()
        out["memfds_after_close"] = memfds()
        print(json.dumps(out), flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
