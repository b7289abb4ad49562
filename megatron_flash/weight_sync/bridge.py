"""Push the trainer's weights to the engines after an optimizer step: the bridge a trainer job owns.

    plan.py        who sends (one sender per PP stage) and what: HF tensors in buckets
    delta.py       the sender's kept engine-dtype copy and the bucket encoder (plain, full, delta)
    delta_plan.py  which engines get a delta, a full push with checksums, or a plain push
    execute.py     the pass protocol to a set of engines (pause → transfer → version → resume),
                   failure and re-sync of dirty engines
    transports/    how the bytes move: ipc (CUDA IPC / shared memory), broadcast (gloo/NCCL group),
                   disk (HF safetensors); one module each behind one protocol
    colocate.py    colocated engines' memory hand-off around training
    probe.py       after the sync: engines vs trainer, teacher-forced logprobs of fixed sequences
    calls.py       concurrent engine calls from rank 0 and the collectives that share their outcome

The bridge decides what a sync's outcome means. An engine still dirty after its re-syncs is taken out
of service: removed from this bridge's engines, listed in `SyncReport.failed_urls`, left paused with
its old weight_version. `fail_fast` raises `WeightSyncError` naming the engine and the step; otherwise
the caller reads the report and stops routing to it (a sync that leaves no engine serving always
raises). Probe: `SyncReport.max_abs_logprob_diff` / `mean_abs_logprob_diff`; a mean above
`probe_threshold` raises. An engine that cannot answer the probe (it died after its sync) is taken out
of service like one whose sync failed; a probe no engine answers raises.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence

from megatron_flash.engines.client_replies import lora_adapter_name
from megatron_flash.trace import TRACER, TRAINER
from megatron_flash.weight_sync import probe as probe_lib
from megatron_flash.weight_sync.calls import EngineCalls, from_rank0, sum_over_ranks
from megatron_flash.weight_sync.colocate import MemoryHandoff
from megatron_flash.weight_sync.delta_plan import DeltaPlan
from megatron_flash.weight_sync.execute import Executor
from megatron_flash.weight_sync.plan import sender_bytes_bound
from megatron_flash.weight_sync.report import SyncReport, WeightSyncError
from megatron_flash.weight_sync.transports import TRANSPORTS, TransportContext, make_transport

__all__ = ["SyncReport", "TRANSPORTS", "WeightBridge", "WeightSyncError", "default_disk_dir"]


class WeightBridge:
    """Owns the engine connections of one trainer job; `sync(version)` is called on every rank.

    `on_bucket(index)` (tests) is called on each sender after bucket `index` of a pass went out.
    """

    def __init__(self, policy: Any, engine_urls: Sequence[str], *, transport: str = "ipc", bucket_mb: float = 512,
                 pause_mode: str = "retract", api_key: Optional[str] = None, disk_dir: str = "",
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0, engine_tp_size: int = 1,
                 max_resync: int = 1, fail_fast: bool = False, probe: bool = True, probe_threshold: float = 0.05,
                 alive_timeout_s: float = 10.0, on_bucket: Optional[Callable[[int], None]] = None,
                 colocate: bool = False, lora: str = "", delta: str = "off", delta_anchor_every: int = 20,
                 delta_max_density: float = 0.5, engine_dtype: Optional[str] = None) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"weight_sync.bucket_mb must be > 0, got {bucket_mb!r}")
        if max_resync < 0:
            raise ValueError(f"weight_sync.max_resync must be >= 0, got {max_resync!r}")
        if probe_threshold <= 0:
            raise ValueError(f"weight_sync.probe_threshold must be > 0, got {probe_threshold!r}")
        if engine_tp_size < 1:
            raise ValueError(f"engine_tp_size must be >= 1, got {engine_tp_size!r}")
        self.policy, self.urls = policy, [u.rstrip("/") for u in engine_urls]
        self.api_key, self.timeout_s = api_key, timeout_s
        self.max_resync, self.fail_fast = max_resync, fail_fast
        self.probe_enabled, self.probe_threshold = probe, probe_threshold
        self.failed: dict[str, str] = {}
        """Engines taken out of service by earlier syncs: url → why."""
        self.rank0 = policy.layout.rank == 0
        self.calls = EngineCalls(api_key=api_key, timeout_s=timeout_s, alive_timeout_s=alive_timeout_s)
        bucket_bytes = max(1, int(bucket_mb * 2**20))
        ctx = TransportContext(
            calls=self.calls, layout=policy.layout, engine_tp_size=engine_tp_size, master_address=master_address,
            disk_dir=disk_dir, export_hf=policy.export_hf, in_service=lambda: self.urls, bucket_bytes=bucket_bytes,
            sender_bytes_bound=sender_bytes_bound(policy))
        if lora not in ("", "merged", "adapter"):
            raise ValueError(f"weight_sync.lora must be merged or adapter, got {lora!r}")
        self.lora = lora
        self._probe_adapter: Optional[str] = None  # the adapter name the probe scores (adapter mode)
        """"" (full weights), merged (W + s·B·A, a full-weight push) or adapter (the adapters alone, by name)."""
        if lora == "adapter":
            from megatron_flash.hf.io import gather_adapter
            from megatron_flash.weight_sync.transports.adapter import AdapterTransport

            self.transport = AdapterTransport(ctx, via=transport, config=policy.peft_config(), gather=lambda: gather_adapter(
                policy.model, spec=policy.spec, layout=policy.layout))
        else:
            self.transport = make_transport(transport, ctx)
        self.memory = MemoryHandoff(self.calls) if colocate else None
        if delta != "off" and (colocate or lora == "adapter"):
            raise ValueError(f"weight_sync.delta={delta} needs engines that keep their weights (not colocated) and "
                             "full-weight pushes (not weight_sync.lora=adapter)")
        self.delta = DeltaPlan(mode=delta, anchor_every=delta_anchor_every, engine_dtype=engine_dtype,
                               max_density=delta_max_density, calls=self.calls, rank0=self.rank0)
        self.executor = Executor(policy, self.transport, self.calls, bucket_bytes=bucket_bytes,
                                 pause_mode=pause_mode, memory=self.memory, encoder=self.delta.encoder,
                                 on_bucket=on_bucket)

    @classmethod
    def from_config(cls, policy: Any, engine_urls: Sequence[str], config: Any, **kwargs: Any) -> "WeightBridge":
        """From a `WeightSyncConfig`; `kwargs` carry what lives elsewhere (pause_mode, api_key, disk_dir…,
        probe_threshold as RunConfig.probe_threshold() resolves it)."""
        threshold = kwargs.pop("probe_threshold", None) or config.probe_threshold or 0.05
        return cls(policy, engine_urls, transport=config.transport, bucket_mb=config.bucket_mb,
                   max_resync=config.max_resync, fail_fast=config.fail_fast, probe=config.probe,
                   probe_threshold=threshold, timeout_s=config.timeout_s,
                   delta_anchor_every=config.delta_anchor_every, delta_max_density=config.delta_max_density,
                   **kwargs)

    def _take_out(self, urls_errors: dict[str, str]) -> None:
        self.delta.forget(list(urls_errors))
        for url, why in urls_errors.items():
            self.urls.remove(url)
            self.failed[url] = why

    def release_memory(self) -> dict[str, str]:
        """Colocated mode, before training: every engine in service pauses and releases its memory; one
        that cannot is taken out of service. Collective; returns url → error."""
        if self.memory is None:
            raise RuntimeError("release_memory: this bridge was built without colocate=True")
        errors = from_rank0(self.memory.release(self.urls) if self.rank0 else {})
        self._take_out(errors)
        return errors

    def readmit(self, urls: Sequence[str]) -> None:
        """Put engines (restarted by the launcher) back among the targets of the next sync, which
        sends them every weight. Every rank must call it with the same list."""
        for url in self._forget(urls):
            if url not in self.urls:
                self.urls.append(url)

    def close(self) -> None:
        """Free what the transport holds (ipc buffers, a broadcast group). The bridge is not used after."""
        self.transport.close()

    def __enter__(self) -> "WeightBridge":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def remove(self, urls: Sequence[str]) -> None:
        """Engines that left the fleet: no push goes to them again (nothing of them is kept). Every rank,
        the same list."""
        for url in self._forget(urls):
            if url in self.urls:
                self.urls.remove(url)

    def _forget(self, urls: Sequence[str]) -> list[str]:
        """Drop what the transport, the delta plan and the memory hand-off keep of `urls`, and their
        failures; the URLs, normalised."""
        urls = [u.rstrip("/") for u in urls]
        self.transport.forget(urls)
        self.delta.forget(urls)
        if self.memory is not None:
            self.memory.forget(urls)
        for url in urls:
            self.failed.pop(url, None)
        return urls

    def sync(self, version: int, *, only: Optional[Sequence[str]] = None, trial: Sequence[str] = ()) -> SyncReport:
        """Push the current weights as `version` to every engine in service (`only`: to those of them).
        `trial`: engines joining the fleet; one that fails the probe is taken out instead of failing the
        push. Collective: all ranks."""
        t0 = time.perf_counter()
        self._probe_adapter = lora_adapter_name(version) if self.lora == "adapter" else None
        targets = [u for u in self.urls if only is None or u in only]
        if not targets:
            raise WeightSyncError(f"weight sync to version {version}: no engine in service "
                                  f"(out of service: {self.failed or 'none'})")
        try:
            groups, anchor = self.delta.groups(version, targets)
        except ValueError as error:
            raise WeightSyncError(f"weight sync to version {version}: {error}") from None
        self.transport.modes = {m for m, _ in groups}
        with TRACER.span("prepare", "sync", TRAINER, transport=self.transport.name):
            self.transport.prepare(version)
        outs = [self.executor.run(version, urls, max_resync=self.max_resync, mode=mode,
                                  base=self.delta.encoder.base_version) for mode, urls in groups]
        errors = {u: m for out in outs for u, m in out.errors.items()}
        first_errors = {u: m for out in outs for u, m in out.first_errors.items()}
        all_errors = {u: (errors[u] if u in errors else f"{first_errors[u]} (re-synced)") for u in first_errors}
        counts = self.delta.settle(version, groups, errors, all_errors)
        self._take_out(errors)
        report = SyncReport(version=version, seconds=0.0, bytes_sent=sum(o.bytes_sent for o in outs),
                            num_buckets=sum(o.num_buckets for o in outs),
                            transport=self.transport.name, synced_urls=[u for u in targets if u not in errors],
                            failed_urls=[u for u in targets if u in errors],
                            resynced_urls=[u for o in outs for u in o.resynced], errors=all_errors)
        report.fill_delta([p for o in outs for p in o.passes], anchor=anchor, **counts,
                          copy_bytes=sum_over_ranks(self.delta.encoder.copy_bytes())[0] if self.delta.enabled else 0)

        def fail(message: str) -> WeightSyncError:
            report.seconds = time.perf_counter() - t0
            return WeightSyncError(f"weight sync to version {version}: {message}", report=report)

        if errors and ((self.fail_fast and not set(errors) <= set(trial)) or not report.synced_urls):
            raise fail("engine(s) taken out of service: " + "; ".join(f"{u}: {m}" for u, m in errors.items()))
        if self.probe_enabled:
            t1 = time.perf_counter()
            report.max_abs_logprob_diff, report.mean_abs_logprob_diff, worst, lost = self.probe(report.synced_urls, trial)
            report.probe_seconds = time.perf_counter() - t1
            self._take_out({u: f"post-sync probe: {m}" for u, m in lost.items()})
            for url in lost:  # died between its sync and the probe: out, like a failed sync
                report.synced_urls.remove(url)
                report.failed_urls.append(url)
                report.errors[url] = self.failed[url]
            if lost and self.fail_fast and not set(lost) <= set(trial):
                raise fail("engine(s) taken out of service: "
                           + "; ".join(f"{u}: {m}" for u, m in report.errors.items()))
            if report.mean_abs_logprob_diff > self.probe_threshold:  # NaN: only refused joiners were probed
                raise fail(f"post-sync probe failed on {worst}: mean |Δ logprob| {report.mean_abs_logprob_diff:.4g} "
                           f"(max {report.max_abs_logprob_diff:.4g}) > probe_threshold {self.probe_threshold:g}: "
                           "the engine does not serve the trainer's weights")
        report.seconds = time.perf_counter() - t0
        return report

    def probe(self, urls: Sequence[str], trial: Sequence[str] = ()) -> tuple[float, float, str, dict[str, str]]:
        """Teacher-forced logprobs of fixed sequences: trainer (all ranks) vs every engine in `urls`
        (rank 0). Returns (max, mean, worst url, {url: error} of engines that could not answer), the
        same on every rank; raises when none answered. Collective."""
        with TRACER.span("probe", "sync", TRAINER, engines=len(urls)):
            result = from_rank0(probe_lib.run_probe(self.policy, urls, api_key=self.api_key, timeout_s=self.timeout_s,
                                                    rank0=self.rank0, lora_name=self._probe_adapter,
                                                    trial=trial, threshold=self.probe_threshold))
        if isinstance(result, str):
            raise WeightSyncError(result)
        return result


def default_disk_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "weights_for_engines")
