"""disk: through a directory the engines can read, with one POST /update_weights_from_disk per engine,
which carries the version itself.

A plain push is the trainer's HF safetensors export (atomic). A push with checksums (weight_sync.delta:
full or delta mode, delta.py) is its encoded buckets instead, one safetensors file per bucket and
sender in a folder of its own (`delta-v{version}-{mode}-{n}`); the engine reads every file of the
folder, applies what is a delta, copies what is whole, and verifies the checksums before it takes the
version. Rank 0 removes the folder once the engines answered.
"""

from __future__ import annotations

import os
import shutil
from typing import ClassVar, Optional

from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import TransportContext, TransportDefaults


class DiskTransport(TransportDefaults):
    name: ClassVar[str] = "disk"
    streams_buckets: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext) -> None:
        if not ctx.disk_dir:
            raise ValueError("weight_sync transport 'disk' needs a shared directory (disk_dir)")
        super().__init__(ctx)
        self.folder = ""
        self._files = 0
        self._count = 0

    def prepare(self, version: int) -> None:
        if "plain" in self.modes:
            self.ctx.export_hf(self.ctx.disk_dir)

    def start_files(self, version: int, mode: str) -> None:
        """Every rank, before a pass with checksums: the folder its buckets go to (the same on every rank)."""
        self._count += 1
        self.folder = os.path.join(self.ctx.disk_dir, f"delta-v{version}-{mode}-{self._count}")
        self._files = 0
        os.makedirs(self.folder, exist_ok=True)

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        from safetensors.torch import save_file

        if not self.folder:
            raise RuntimeError("transport 'disk' sends buckets only in a pass with checksums (start_files first)")
        layout = self.ctx.layout
        path = os.path.join(self.folder, f"r{layout.rank:05d}-{self._files:05d}.safetensors")
        self._files += 1
        save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, path + ".partial")
        os.replace(path + ".partial", path)
        return {}

    def load(self, version: int, urls: list[str], verify_tensors: Optional[int] = None) -> Errors:
        path = self.folder if verify_tensors is not None else self.ctx.disk_dir
        try:
            return self.ctx.calls.fan("update_weights_from_disk", urls, lambda c: c.update_weights_from_disk(
                path, weight_version=str(version), flush_cache=False, verify_tensors=verify_tensors))[1]
        finally:
            if verify_tensors is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = ""
