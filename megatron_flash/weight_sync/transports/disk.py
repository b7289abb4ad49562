"""disk: the trainer exports HF safetensors (atomically) into a directory the engines can read, then
one POST /update_weights_from_disk per engine loads it and carries the version itself."""

from __future__ import annotations

from typing import ClassVar

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

    def prepare(self, version: int) -> None:
        self.ctx.export_hf(self.ctx.disk_dir)

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        raise NotImplementedError("transport 'disk' loads the whole state; it sends no buckets")

    def load(self, version: int, urls: list[str]) -> Errors:
        return self.ctx.calls.fan("update_weights_from_disk", urls, lambda c: c.update_weights_from_disk(
            self.ctx.disk_dir, weight_version=str(version), flush_cache=False))[1]
