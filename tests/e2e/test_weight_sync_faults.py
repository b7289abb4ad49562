"""Weight sync under faults: a trainer syncs to two local engine servers, A and B, and something goes
wrong with A while buckets are being sent. The bridge's `on_bucket` hook makes it deterministic
(buckets of 50 KB: ~5 per sync; the fault hits A right after bucket 1 went out).

  scenario  fault after bucket 1                     expected
  --------  ---------------------------------------  ------------------------------------------------
  kill      SIGKILL engine A                         v1: A out of service, named with the step
                                                     (WeightSyncError with fail_fast, else the report);
                                                     B serves v1 exactly; then v2 to B alone, exact
  resync    close A's weight-update session behind   A's next bucket fails, A still answers → re-synced
            the bridge's back                        from scratch (broadcast: B too, it shared A's
                                                     group); both serve v1 exactly; A reported the
                                                     old version while it was partial
  corrupt   reload A from a different-seed model     the post-sync probe raises, naming A, the diff
            behind the bridge's back                 and the threshold
  stall     SIGSTOP engine A (alive, silent)         A's next call gets no reply: abandoned at
                                                     weight_sync.timeout_s (5 s here), named with the
                                                     endpoint and the deadline; A out of service, B
                                                     serves v1 exactly
  probe_kill  (no bucket fault) SIGKILL engine A     A is out of service ("post-sync probe"), B was
            after every bucket went out, before the  probed and serves v1 exactly; the sync does not
            post-sync probe                          raise; then v2 to B alone

"Exactly" = an engine samples and its behavior logprobs equal the trainer's logprobs of the same
tokens (≤ 1e-4, fp32), and it reports the expected weight_version.

Each case runs this file as a script (`python` or `torchrun` for TP2): the trainer is a separate
process, which must survive the fault; its last stdout line is a JSON summary.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.conftest import memfd_links, run_tool  # noqa: E402

FAULT_AFTER_BUCKET = 1
CASES = [("kill", "ipc", 1, True), ("kill", "broadcast", 1, False), ("kill", "ipc", 2, False),
         ("resync", "ipc", 1, True), ("resync", "broadcast", 1, True), ("corrupt", "ipc", 1, False),
         ("probe_kill", "ipc", 1, False), ("stall", "ipc", 1, False)]


@pytest.mark.parametrize("scenario,transport,tp,fail_fast", CASES,
                         ids=[f"{s}-{t}-tp{p}{'-fail_fast' if f else ''}" for s, t, p, f in CASES])
@pytest.mark.serial  # compares /dev/shm before and after: another test's files there would show up
def test_weight_sync_fault(tiny_models, seed1_model, tmp_path, scenario: str, transport: str, tp: int,
                           fail_fast: bool) -> None:
    args = [os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
            "--model-path", tiny_models["llama"], "--other-model", seed1_model, "--scenario", scenario,
            "--transport", transport, "--tp", str(tp), "--run-dir", str(tmp_path)]
    args += ["--fail-fast"] if fail_fast else []
    shm_before = set(os.listdir("/dev/shm"))
    proc = run_tool(args, nproc=tp, timeout=400)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(os.listdir("/dev/shm")) == shm_before  # no segment left behind
    a, b = out["urls"]
    first = out["first"]
    if scenario == "kill":
        assert first["raised"] == fail_fast
        said = first["message"] if fail_fast else first["errors"][a]
        assert a in said and f"bucket {FAULT_AFTER_BUCKET + 1}" in said, first
        assert first["failed_urls"] == [a] and first["synced_urls"] == [b], first
        # broadcast: B shared the broken group, so it had to be re-synced (alone, in a fresh group)
        assert first["resynced_urls"] == ([b] if transport == "broadcast" else []), first
        assert out["b_after_first"] == {"version": "1", "ok": True}, out
        second = out["second"]
        assert second["raised"] is False and second["synced_urls"] == [b] and second["failed_urls"] == []
        assert out["b_after_second"] == {"version": "2", "ok": True}, out
        assert second["probe_max"] <= 1e-4
        if transport == "ipc":  # one set of two buffers (fd + the mmap's duplicate each): the old set freed
            assert out["memfds"] == 4, out
    elif scenario == "stall":
        assert first["raised"] is False and first["failed_urls"] == [a] and first["synced_urls"] == [b], first
        assert a in first["errors"][a] and "no reply within 5s" in first["errors"][a], first
        assert out["b_after_first"] == {"version": "1", "ok": True}, out
        assert out["first_seconds"] < 60, out  # the deadline, not the 600 s default
    elif scenario == "probe_kill":
        assert first["raised"] is False, first
        assert first["failed_urls"] == [a] and first["synced_urls"] == [b], first
        assert first["errors"][a].startswith("post-sync probe: "), first
        assert first["probe_max"] <= 1e-4  # B's, the only engine probed successfully
        assert out["b_after_first"] == {"version": "1", "ok": True}, out
        second = out["second"]
        assert second["raised"] is False and second["synced_urls"] == [b] and second["failed_urls"] == []
        assert out["b_after_second"] == {"version": "2", "ok": True}, out
    elif scenario == "resync":
        assert first["raised"] is False, first
        assert first["failed_urls"] == [], first
        # ipc: only A is re-synced; broadcast: B was in the same (now broken) group, so it is too
        assert set(first["resynced_urls"]) == ({a, b} if transport == "broadcast" else {a}), first
        assert a in first["errors"] and f"bucket {FAULT_AFTER_BUCKET + 1}" in first["errors"][a]
        assert out["a_version_while_partial"] == "default"  # never advanced by a bucket
        assert out["a_after_first"] == {"version": "1", "ok": True}, out
        assert out["b_after_first"] == {"version": "1", "ok": True}, out
        assert first["probe_max"] <= 1e-4
    else:
        assert first["raised"] is True
        assert "probe" in first["message"] and a in first["message"] and "probe_threshold 0.05" in first["message"]
        assert first["probe_mean"] > 0.05


# ---------------------------------------------------------------------------------------------- the trainer
def _main() -> int:
    import argparse
    import asyncio
    import signal
    import socket
    import time
    import urllib.parse
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--other-model", required=True)
    p.add_argument("--scenario", choices=["kill", "resync", "corrupt", "probe_kill", "stall"], required=True)
    p.add_argument("--transport", default="ipc")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--fail-fast", action="store_true")
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.ports import free_ports
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.types import TrainBatch
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.weight_sync.bridge import WeightBridge, WeightSyncError

    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, tp_size=args.tp, micro_batch_size=8,
                                           optimizer=OptimizerConfig(name="sgd", lr=0.5)))
    rank0 = dist.get_rank() == 0
    launcher = None
    shared: list = [None, None]
    if rank0:
        launcher = EngineLauncher(backend="local", model_path=args.model_path, num_engines=2, base_port=free_ports(2),
                                  run_dir=args.run_dir, startup_timeout_s=180)
        launcher.__enter__()
        shared = [list(launcher.urls), list(launcher.pids)]
    dist.broadcast_object_list(shared, src=0)
    urls, pids = shared
    a, b = urls
    out: dict = {"urls": urls}

    def call(url: str, method: str, *a_: object, **kw: object) -> object:
        async def go() -> object:
            async with EngineClient(url, max_retries=0) as client:
                return await getattr(client, method)(*a_, **kw)
        return asyncio.run(go())

    def step() -> None:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(4, policy.spec.vocab_size, (8, 12), generator=gen)
        policy.train_step(TrainBatch(tokens=tokens, loss_mask=torch.ones(8, 12)), nll_loss_fn)

    def serves(url: str) -> dict:
        """The engine samples; its behavior logprobs must be the trainer's. Collective."""
        prompts = [[11, 9, 12, 10, 18], [5, 6, 7, 8]]
        box: list = [None]
        if rank0:
            async def sample() -> list:
                async with EngineClient(url) as client:
                    return [await client.generate(pr, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True})
                            for pr in prompts]
            box = [[(pr, r.output_ids, r.output_logprobs, r.weight_version) for pr, r in zip(prompts, asyncio.run(sample()))]]
        dist.broadcast_object_list(box, src=0)
        worst = 0.0
        for prompt, ids, engine_lp, _ in box[0]:
            seq = torch.tensor([prompt + ids])
            lp, _ = policy.compute_logprobs(TrainBatch(tokens=seq, loss_mask=torch.zeros(seq.shape)))
            worst = max(worst, (lp[0, len(prompt):].double() - torch.tensor(engine_lp, dtype=torch.float64)).abs().max().item())
        return {"version": box[0][0][3], "ok": worst <= 1e-4}

    def wait_refused(url: str) -> None:
        host, port = urllib.parse.urlparse(url).hostname, urllib.parse.urlparse(url).port
        for _ in range(200):
            try:
                socket.create_connection((host, port), timeout=0.2).close()
            except OSError:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{url} still accepts connections after SIGKILL")

    def memfds() -> int:
        return len(memfd_links())

    faulted: list = []

    def on_bucket(index: int) -> None:
        if faulted or index != FAULT_AFTER_BUCKET or args.scenario == "probe_kill":
            return
        faulted.append(index)
        if args.scenario == "kill":
            os.kill(pids[0], signal.SIGKILL)
            wait_refused(a)
        elif args.scenario == "stall":
            os.kill(pids[0], signal.SIGSTOP)  # the process lives and keeps its sockets open: no reply, no reset
        elif args.scenario == "resync":
            out["a_version_while_partial"] = call(a, "get_weight_version")
            call(a, "end_weight_update")  # the server's session closes: A's next bucket is refused
        else:
            call(a, "update_weights_from_disk", args.other_model)  # no version: looks like nothing happened

    def run_sync(version: int) -> dict:
        try:
            report, raised, message = bridge.sync(version), False, ""
        except WeightSyncError as error:
            report, raised, message = error.report, True, str(error)
        return {"raised": raised, "message": message, "synced_urls": report.synced_urls,
                "failed_urls": report.failed_urls, "resynced_urls": report.resynced_urls, "errors": report.errors,
                "probe_max": report.max_abs_logprob_diff, "probe_mean": report.mean_abs_logprob_diff}

    code = 0
    try:
        step()
        # A broadcast cut mid-sync (resync) waits timeout_s, and the stalled engine is waited for at
        # each call and at the liveness check: short deadlines, far above a tiny model's calls (ms).
        bridge = WeightBridge(policy, urls, transport=args.transport, bucket_mb=0.05, fail_fast=args.fail_fast,
                              on_bucket=on_bucket, timeout_s=5 if args.scenario == "stall" else 10,
                              alive_timeout_s=5)
        if args.scenario == "probe_kill":  # A dies after its sync, before the probe reaches it
            probe = bridge.probe

            def kill_then_probe(targets: list, trial: tuple = ()) -> tuple:
                if rank0 and not faulted:
                    faulted.append("probe")
                    os.kill(pids[0], signal.SIGKILL)
                    wait_refused(a)
                return probe(targets, trial)
            bridge.probe = kill_then_probe
        t0 = time.monotonic()
        out["first"] = run_sync(1)
        out["first_seconds"] = time.monotonic() - t0
        if args.scenario != "corrupt":
            out["b_after_first"] = serves(b)
        if args.scenario == "resync":
            out["a_after_first"] = serves(a)
        if args.scenario in ("kill", "probe_kill"):
            step()  # the trainer carries on: new weights, to the survivor only
            out["second"] = run_sync(2)
            out["b_after_second"] = serves(b)
            out["memfds"] = memfds()  # ipc: the buffer set made for the new engine set, the old one freed
    except BaseException:
        code = 1
        raise
    finally:
        if rank0:
            print(json.dumps(out), flush=True)
        if launcher is not None:
            if args.scenario == "stall":
                os.kill(pids[0], signal.SIGCONT)  # so that it can be stopped
            launcher.__exit__(None, None, None)
        destroy_distributed()
    return code


if __name__ == "__main__":
    sys.exit(_main())
