"""adapter (weight_sync.lora=adapter): only the LoRA adapters move, through the engines' LoRA API, under
a versioned name (`policy-v{version}`, engines/client_replies.py); the base never leaves the engines.

  prepare (every rank)  gather the adapters, HF/PEFT-named, on rank 0 (megabytes: one object gather);
                        rank 0 unloads adapters two versions old (their requests keep running on
                        SGLang until they end; the local engine just forgets the name); disk: writes
                        the PEFT folder `{disk_dir}/policy-v{version}`
  load (rank 0)         per engine: /load_lora_adapter_from_tensors (ipc: one flattened bucket pickled
                        into shared memory, SGLang's tensor format) or /load_lora_adapter (disk), then
                        /update_weight_version
The previous version's adapter stays loaded for one more push: requests sent before the rollout side
learns of the new version still name it, and on SGLang they run on exactly that adapter (the label
of their samples is the name's version). The local engine merges the new adapter into its weights.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import shutil
from typing import Callable, ClassVar, Optional, Sequence

from megatron_flash.engines.client_replies import lora_adapter_name, lora_adapter_version
from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import TransportContext
from megatron_flash.weight_sync.transports.flat_bucket import flatten_by_dtype

logger = logging.getLogger(__name__)

UNLOAD_TIMEOUT_S = 2.0
"""SGLang answers an unload only once the requests naming the adapter end; the unload itself goes on."""


class AdapterTransport:
    name: ClassVar[str] = "adapter"
    streams_buckets: ClassVar[bool] = False
    serial_stages: ClassVar[bool] = False
    one_sender_per_stage: ClassVar[bool] = False
    copies_buckets: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext, *, via: str, gather: Callable[[], dict], config: dict) -> None:
        if via not in ("ipc", "disk"):
            raise ValueError(f"weight_sync.lora=adapter moves adapters by ipc or disk, not {via!r}")
        if via == "disk" and not ctx.disk_dir:
            raise ValueError("weight_sync.lora=adapter with transport 'disk' needs a shared directory (disk_dir)")
        self.ctx, self.via, self.gather, self.config = ctx, via, gather, config
        self.rank0 = ctx.layout.rank == 0
        self.loaded: dict[str, list[str]] = {}
        """url → adapter names loaded there by this bridge, oldest first."""
        self.loaded_bytes = 0
        self._tensors: dict = {}

    def prepare(self, version: int) -> None:
        self._tensors = self.gather()
        if not self.rank0:
            return
        self.loaded_bytes = sum(t.numel() * t.element_size() for t in self._tensors.values())
        self._unload_old(version)
        if self.via == "disk":
            from megatron_flash.hf.adapters import write_peft_adapter
            from megatron_flash.hf.io import replace_dir

            out = self._folder(version)
            write_peft_adapter(out + ".partial", self._tensors, self.config)
            replace_dir(out + ".partial", out)
            for entry in os.listdir(self.ctx.disk_dir):  # folders of versions no engine can load any more
                old = lora_adapter_version(entry)
                if old is not None and old < version - 1:
                    shutil.rmtree(os.path.join(self.ctx.disk_dir, entry), ignore_errors=True)

    def _folder(self, version: int) -> str:
        return os.path.join(self.ctx.disk_dir, lora_adapter_name(version))

    def load(self, version: int, urls: list[str], verify_tensors: Optional[int] = None) -> Errors:
        name = lora_adapter_name(version)
        fan = self.ctx.calls.fan
        again = [u for u in urls if name in self.loaded.get(u, [])]  # a re-sync of a dirty engine
        if again:
            fan(f"unload_lora_adapter({name}) before its re-sync", again, lambda c: c.unload_lora_adapter(name))
            for url in again:
                self.loaded[url].remove(name)
        errors = self._load(name, version, urls)
        # An engine that already holds this name (a run before this one attached to it, or a load whose
        # answer was lost) gets it unloaded and loaded again: its content is not ours to trust.
        taken = [u for u, m in errors.items() if "already loaded" in m]
        if taken:
            fan(f"unload_lora_adapter({name}) left by someone else", taken, lambda c: c.unload_lora_adapter(name))
            errors = {u: m for u, m in errors.items() if u not in taken} | self._load(name, version, taken)
        ok = [u for u in urls if u not in errors]
        for url in ok:
            self.loaded.setdefault(url, []).append(name)
        _, more = fan("update_weight_version", ok, lambda c: c.update_weight_version(str(version)))
        errors.update(more)
        return errors

    def _load(self, name: str, version: int, urls: list[str]) -> Errors:
        if not urls:
            return {}
        if self.via == "disk":
            path = self._folder(version)
            return self.ctx.calls.fan(f"load_lora_adapter({name})", urls, lambda c: c.load_lora_adapter(name, path))[1]
        payload = self._payload()
        return self.ctx.calls.fan(f"load_lora_adapter_from_tensors({name})", urls, lambda c: c.load_lora_adapter_from_tensors(
            name, self.config, payload, load_format="flattened_bucket"))[1]

    def _payload(self) -> list[str]:
        """The adapter as SGLang's flattened bucket, pickled into shared memory (one copy per engine TP rank)."""
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        mp.set_sharing_strategy("file_system")
        ((flat, metadata),) = flatten_by_dtype(sorted(self._tensors.items()), shared=True)
        self._flat = flat  # its shared-memory file lives until the engines have read it
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
        return [base64.b64encode(buf.getvalue()).decode()] * self.ctx.engine_tp_size

    def _unload_old(self, version: int) -> None:
        stale = {url: [n for n in names if (lora_adapter_version(n) or 0) < version - 1]
                 for url, names in self.loaded.items() if url in self.ctx.in_service()}
        for name in sorted({n for names in stale.values() for n in names}):
            urls = [u for u, names in stale.items() if name in names]
            _, errors = self.ctx.calls.fan(f"unload_lora_adapter({name})", urls,
                                           lambda c: c.unload_lora_adapter(name), timeout_s=UNLOAD_TIMEOUT_S, retries=0)
            for url in urls:
                self.loaded[url].remove(name)
            if errors:
                logger.info("unload of %s not confirmed (requests naming it may still run): %s", name, errors)

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        raise NotImplementedError("transport 'adapter' loads whole adapters; it sends no buckets")

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:  # a restarted engine has none of them
            self.loaded.pop(url, None)

    def drain(self) -> Errors:
        return {}

    def close(self) -> None:
        self._tensors = {}
