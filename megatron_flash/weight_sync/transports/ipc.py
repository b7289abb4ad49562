"""ipc: each bucket pickled with torch's ForkingPickler (CUDA IPC handles on GPU, shared-memory files
on CPU with the `file_system` strategy) and POSTed to /update_weights_from_tensor of every engine,
one copy of the payload per engine TP rank."""

from __future__ import annotations

import base64
import io
from typing import ClassVar

from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import StreamingTransport


class IpcTransport(StreamingTransport):
    name: ClassVar[str] = "ipc"

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        mp.set_sharing_strategy("file_system")  # file_descriptor sharing crashes SGLang's scheduler
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
        payload = [base64.b64encode(buf.getvalue()).decode()] * self.ctx.engine_tp_size
        # `bucket` stays referenced until every engine answered: the shared-memory files live until then.
        return self.ctx.calls.fan(f"{step} (update_weights_from_tensor)", urls, lambda c: c.update_weights_from_tensor(
            payload, load_format=None, flush_cache=False, weight_version=None))[1]
