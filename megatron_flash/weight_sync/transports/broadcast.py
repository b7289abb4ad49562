"""broadcast: one gloo/NCCL group per PP stage, {that stage's sender (rank 0)} ∪ {every engine rank}.
POST /update_weights_from_distributed announces a bucket's names/dtypes/shapes while the sender
broadcasts it: as one uint8 tensor with SGLang's `load_format="flattened_bucket"` (one collective per
bucket; the tensors ordered by element size, largest first, so that every byte offset is aligned for
its dtype, which the receivers check) where that saves time (`coalesce`), else one tensor at a time. Stages take turns (the executor's barrier) because an engine serves one update
at a time: two stages broadcasting at once to two engines that picked them in opposite orders would
deadlock. The group lives across syncs while its members stay the same."""

from __future__ import annotations

import gc
import threading
import uuid
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flash.engines.cuda_handles import device_uuid
from megatron_flash.engines.process_group import destroy_weight_update_group, new_weight_update_group
from megatron_flash.ports import free_ports
from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import StreamingTransport, TransportContext
from megatron_flash.weight_sync.transports.flat_bucket import nbytes_of, pack


class BroadcastTransport(StreamingTransport):
    name: ClassVar[str] = "broadcast"
    serial_stages: ClassVar[bool] = True
    one_sender_per_stage: ClassVar[bool] = True  # the group broadcasts from its member 0

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._group: Optional[tuple[tuple[str, ...], str, Any]] = None  # this stage's (members, name, group)
        self._flat: Optional[torch.Tensor] = None  # one bucket's bytes, reused (each broadcast completes first)

    def forget(self, urls: Sequence[str]) -> None:
        if self._group is not None and any(u in self._group[0] for u in urls):
            self._drop_group()  # a restarted process is not in the old group: form a new one

    def _stage_group(self, urls: list[str]) -> tuple[str, Any]:
        """This stage's group with exactly `urls`; a group with other members is torn down first."""
        members = tuple(urls)
        if self._group is not None and self._group[0] == members:
            return self._group[1], self._group[2]
        self._drop_group()
        ctx = self.ctx
        name = f"mf_weights_pp{ctx.layout.pp_rank}_{uuid.uuid4().hex[:8]}"
        port = free_ports(1)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            self._refuse_engines_on_this_gpu(urls)
        world = 1 + len(urls) * ctx.engine_tp_size
        joins: dict[str, Any] = {}

        def engines_join() -> None:
            offsets = {u: 1 + i * ctx.engine_tp_size for i, u in enumerate(urls)}
            joins.update(ctx.calls.fan("init_weights_update_group", urls, lambda c: c.init_weights_update_group(
                master_address=ctx.master_address, master_port=port, rank_offset=offsets[c.url], world_size=world,
                group_name=name, backend=backend))[1])

        timeout_s = ctx.calls.timeout_s
        thread = threading.Thread(target=engines_join, daemon=True)
        thread.start()
        group = new_weight_update_group(master_address=ctx.master_address, master_port=port, rank=0,
                                        world_size=world, group_name=name, backend=backend, timeout_s=timeout_s)
        thread.join(timeout_s)
        if joins or thread.is_alive():
            destroy_weight_update_group(group)
            raise RuntimeError(f"could not form update group {name}: {joins or 'timeout'}")
        self._group = (members, name, group)
        return name, group

    def _refuse_engines_on_this_gpu(self, urls: list[str]) -> None:
        """NCCL cannot put two ranks of one group on one GPU: it fails inside the first collective, the
        engine's side with a rendezvous error that names neither. Engines that report their GPU
        (`device_uuid` in /get_server_info: the local engine) are checked here."""
        mine = same_gpu_engines(urls, self.ctx.calls, torch.cuda.current_device())
        if mine:
            raise RuntimeError(f"weight_sync.transport=broadcast: engine(s) {', '.join(mine)} run on this trainer "
                               f"rank's own GPU, and NCCL cannot join two ranks of a group on one GPU; use "
                               f"weight_sync.transport=ipc (CUDA IPC on the same GPU) for engines beside the trainer")

    def close(self) -> None:
        self._drop_group()
        self._flat = None

    def _flatten(self, ordered: Bucket) -> torch.Tensor:
        nbytes, device = nbytes_of(ordered), ordered[0][1].device
        if self._flat is None or self._flat.numel() < nbytes or self._flat.device != device:
            self._flat = None
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat = self._flat[:nbytes]
        pack(flat, ordered)
        return flat

    def _drop_group(self) -> None:
        """Tear down this stage's group on our side and (best effort) on engines still in service."""
        if self._group is None:
            return
        members, name, group = self._group
        self._group = None
        destroy_weight_update_group(group)
        del group
        gc.collect()  # the last reference gone, our connections close: blocked engines' receives fail now
        live = [u for u in members if u in self.ctx.in_service()]
        self.ctx.calls.fan("destroy_weights_update_group", live, lambda c: c.destroy_weights_update_group(name),
                           timeout_s=self.ctx.calls.alive_timeout_s, retries=0)

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        try:
            name, group = self._stage_group(urls)
        except Exception as error:
            return {u: f"{step}: {error}" for u in urls}
        flat = coalesce(bucket)
        ordered = broadcast_order(bucket) if flat else bucket
        body = dict(names=[n for n, _ in ordered], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in ordered],
                    shapes=[list(t.shape) for _, t in ordered], group_name=name, flush_cache=False,
                    weight_version=None, load_format="flattened_bucket" if flat else None)
        announced: Errors = {}
        calls, timeout_s = self.ctx.calls, self.ctx.calls.timeout_s

        def announce() -> None:
            announced.update(calls.fan(f"{step} (update_weights_from_distributed)", urls,
                                       lambda c: c.update_weights_from_distributed(**body))[1])

        thread = threading.Thread(target=announce, daemon=True)
        thread.start()
        failure = ""
        try:
            if flat:
                dist.broadcast(self._flatten(ordered), group=group, group_src=0)
            else:
                for _, tensor in ordered:
                    dist.broadcast(tensor, group=group, group_src=0)
        except Exception as error:  # a member died mid-collective: the group is unusable for all
            failure = f"{step} (broadcast): {type(error).__name__}: {error}"
        del group  # outside the except block: no traceback frame keeps the group alive either
        if failure:
            self._drop_group()  # closes our connections, so the survivors' receives fail now
            thread.join(timeout_s)
            return {u: announced.get(u, failure) for u in urls}
        thread.join(timeout_s)
        if thread.is_alive():
            announced.update({u: f"{step}: no answer within {timeout_s:g}s" for u in urls})
        if announced:
            self._drop_group()
            return {u: announced.get(u, f"{step}: another member of group {name} failed") for u in urls}
        return {}


COALESCE_MAX_MEAN_BYTES = 1 << 20
"""On the CPU a bucket goes flat only when its tensors average at most this: measured with gloo
(tools/weight_sync/bench.py, 2-core box), 21 tensors of ~15 KB: flat 2.1 ms vs 4.3 ms per tensor;
12 tensors of ~21 MB: flat 0.30–0.32 s vs 0.25–0.26 s (the packing copy costs more than the calls)."""


def coalesce(bucket: Bucket) -> bool:
    """Send this bucket as one flat broadcast? Always on a GPU (packing runs at device-memory speed and
    every NCCL call has its own launch and synchronization cost), on the CPU only for small tensors."""
    if len(bucket) < 2:
        return False
    return bucket[0][1].is_cuda or nbytes_of(bucket) <= COALESCE_MAX_MEAN_BYTES * len(bucket)


def broadcast_order(bucket: Bucket) -> Bucket:
    """The bucket by element size, largest first (stable): packed back to back in this order, every tensor
    starts at a byte offset its dtype divides, as SGLang's flattened_bucket receiver requires."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def same_gpu_engines(urls: Sequence[str], calls: Any, device_index: int) -> list[str]:
    """The engines among `urls` whose reported GPU (`device_uuid`) is this process's CUDA device."""
    infos, _ = calls.fan("get_server_info", list(urls), lambda c: c.server_info(), retries=1)
    mine = device_uuid(device_index)
    return [u for u in urls if (infos.get(u) or {}).get("device_uuid") == mine]
