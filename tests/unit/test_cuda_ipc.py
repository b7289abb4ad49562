"""The CUDA ipc path's pure pieces, on the CPU: the flat-buffer layout and reuse, the device-by-UUID
pickling (torch's own reduction with one argument replaced, this pickler only), the engine's UUID
lookup and allowlist entry, and the transport's routing (which engines get CUDA handles, one payload
per TP rank, the fall-back to host memory on CANNOT_OPEN_CUDA). The CUDA round trip itself (a second
process opening the handles, weights exact) is in tests/gpu/test_gpu_weight_sync.py."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch

from megatron_flash.engines import cuda_handles
from megatron_flash.engines.cuda_handles import CANNOT_OPEN_CUDA, DEVICE_ARG, cuda_index_of
from megatron_flash.engines.weight_payloads import _SafeUnpickler
from megatron_flash.weight_sync.transports import cuda_ipc
from megatron_flash.weight_sync.transports.cuda_ipc import ALIGN, DeviceFlatBuffers


def bucket(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(5, 3, generator=g) * scale),                         # 60 B
        ("b", (torch.randn(7, generator=g) * scale).to(torch.bfloat16)),       # 14 B: odd region size
        ("c", torch.randn(4, 6, generator=g).t() * scale),                     # not contiguous
        ("d", torch.tensor(2.5 * scale)),                                      # 0-d
    ]


def test_flat_buffers_hold_every_byte_per_dtype_in_aligned_regions() -> None:
    buffers = DeviceFlatBuffers()
    flats = buffers.flatten(bucket())
    assert [m[0].dtype for _, m in flats] == [torch.float32, torch.bfloat16]
    base = flats[0][0].untyped_storage().data_ptr()
    for flat, metadata in flats:
        named = [(n, t) for n, t in bucket() if t.dtype == metadata[0].dtype]
        expected = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        assert torch.equal(flat, expected)
        assert (flat.data_ptr() - base) % ALIGN == 0  # each dtype's region starts aligned
        assert [m.name for m in metadata] == [n for n, _ in named]
        assert [(m.start_idx, m.end_idx) for m in metadata] == [
            (sum(t.numel() * t.element_size() for _, t in named[:i]),
             sum(t.numel() * t.element_size() for _, t in named[:i + 1])) for i in range(len(named))]
    assert flats[0][0].untyped_storage().data_ptr() == flats[1][0].untyped_storage().data_ptr()  # one buffer


def test_flat_buffers_alternate_between_two_sets_and_are_reused_across_syncs() -> None:
    buffers = DeviceFlatBuffers()
    ptrs = [buffers.flatten(bucket(scale))[0][0].untyped_storage().data_ptr() for scale in (1.0, 2.0, 3.0, 4.0)]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]
    size = buffers.nbytes
    third = buffers.flatten(bucket(5.0))  # set 0 again: rewritten in place with the new values
    assert torch.equal(third[0][0][:60].view(torch.float32).view(5, 3), bucket(5.0)[0][1])
    assert buffers.nbytes == size
    big = [("e", torch.ones(1000))]  # larger than set 1's buffer: that set grows, set 0 keeps its size
    (flat, _), = buffers.flatten(big)
    assert flat.numel() == 4000 and buffers.nbytes == size // 2 + 4096
    buffers.close()
    assert buffers.nbytes == 0


def test_cpu_tensors_pickle_as_torch_pickles_them_and_the_global_reductions_stay() -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    data = {"flattened_tensor": torch.arange(6, dtype=torch.float32), "metadata": [SimpleNamespace(name="x")]}
    payload = cuda_ipc.dumps_with_device_uuids(data)
    got = _SafeUnpickler(__import__("io").BytesIO(payload)).load()
    assert torch.equal(got["flattened_tensor"], data["flattened_tensor"]) and got["metadata"][0].name == "x"
    assert ForkingPickler._extra_reducers[torch.Tensor] is reduce_tensor  # not patched for anyone else


def test_a_cuda_tensor_is_reduced_with_its_device_uuid(monkeypatch) -> None:
    """torch's reduce_tensor result for a CUDA tensor, with only the device index replaced by its UUID."""
    from torch.multiprocessing import reductions

    args = tuple(range(15))  # the 15 arguments of rebuild_cuda_tensor; index 6 is the device (here 6)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda index: f"GPU-uuid-of-{index}")
    rebuild, out = cuda_ipc._reduce_with_uuid(torch.zeros(1))
    assert rebuild is reductions.rebuild_cuda_tensor
    assert out == (0, 1, 2, 3, 4, 5, "GPU-uuid-of-6", 7, 8, 9, 10, 11, 12, 13, 14)


def test_the_engine_maps_a_uuid_to_its_own_index_or_refuses_by_name() -> None:
    visible = lambda: ["GPU-a", "GPU-b"]  # noqa: E731  (this process's GPUs, in index order)
    assert cuda_index_of("GPU-b", visible) == 1
    assert cuda_index_of(3, visible) == 3  # an index from an unpatched producer is taken as is
    with pytest.raises(ValueError, match=f"{CANNOT_OPEN_CUDA}: its GPU GPU-z is not visible"):
        cuda_index_of("GPU-z", visible)
    with pytest.raises(ValueError, match="index or a UUID"):
        cuda_index_of(None, visible)


def test_the_engine_unpickler_rebuilds_cuda_tensors_through_the_uuid_lookup(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(cuda_handles, "visible_uuids", lambda: ["GPU-a", "GPU-b"])
    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", lambda *a: seen.append(a) or "t")
    rebuild = _SafeUnpickler.find_class(_SafeUnpickler.__new__(_SafeUnpickler), "torch.multiprocessing.reductions",
                                        "rebuild_cuda_tensor")
    args = [0] * 15
    args[DEVICE_ARG] = "GPU-b"
    assert rebuild(*args) == "t" and seen[0][DEVICE_ARG] == 1
    with pytest.raises(pickle.UnpicklingError):  # the allowlist is still closed to everything else
        _SafeUnpickler.find_class(_SafeUnpickler.__new__(_SafeUnpickler), "os", "system")


class FakeEngines:
    """fan() of the bridge's EngineCalls: server info per url, and what each update request carried."""

    def __init__(self, devices: dict[str, str], refuse_cuda: tuple[str, ...] = ()) -> None:
        self.devices, self.refuse_cuda = devices, refuse_cuda
        self.requests: list[tuple[str, str, int]] = []  # (url, step, number of payloads)

    def fan(self, step: str, urls: list[str], call, **kw):
        if "get_server_info" in step:
            return {u: {"device": self.devices[u], "weight_update_shared_memory": True} for u in urls}, {}
        errors = {}
        for url in urls:
            client = SimpleNamespace(
                update_weights_from_tensor=lambda payload, **k: len(payload),
                update_weights_from_shared_memory=lambda spec, entries: 1)
            self.requests.append((url, step, call(client)))
            if "CUDA ipc" in step and url in self.refuse_cuda:
                errors[url] = f"{step}: EngineHTTPError: HTTP 400: Failed to update weights: {CANNOT_OPEN_CUDA}: ..."
        return {}, errors


def transport_for(engines: FakeEngines, tp: int = 1):
    from megatron_flash.weight_sync.transports.base import TransportContext
    from megatron_flash.weight_sync.transports.ipc import IpcTransport

    ctx = TransportContext(calls=engines, layout=None, engine_tp_size=tp, master_address="", disk_dir="",
                           export_hf=lambda d: None, in_service=lambda: list(engines.devices),
                           bucket_bytes=4096, sender_bytes_bound=1 << 20)
    return IpcTransport(ctx)


def test_gpu_buckets_go_as_cuda_handles_to_gpu_engines_only(monkeypatch) -> None:
    monkeypatch.setattr("megatron_flash.weight_sync.transports.ipc.bucket_on_cuda", lambda b: True)
    dumps = []
    monkeypatch.setattr("megatron_flash.weight_sync.transports.ipc.dumps_with_device_uuids",
                        lambda obj: dumps.append(obj) or b"handle")
    engines = FakeEngines({"http://gpu:1": "cuda:0", "http://cpu:2": "cpu"})
    transport = transport_for(engines, tp=2)
    try:
        transport.prepare(1)
        assert transport.send(bucket(), list(engines.devices), "bucket 0") == {}
        assert transport.drain() == {}
    finally:
        transport.close()
    cuda = [r for r in engines.requests if "CUDA ipc" in r[1]]
    assert {r[0] for r in cuda} == {"http://gpu:1"} and len(cuda) == 2  # one request per dtype
    assert all(n == 2 for _, _, n in cuda) and len(dumps) == 4  # a payload pickled per TP rank
    assert {r[0] for r in engines.requests if "shared_memory" in r[1]} == {"http://cpu:2"}
    assert transport.paths == {"http://gpu:1": "cuda", "http://cpu:2": "staged"}


def test_cpu_buckets_never_take_the_cuda_path() -> None:
    engines = FakeEngines({"http://gpu:1": "cuda"})
    transport = transport_for(engines)
    try:
        transport.send(bucket(), ["http://gpu:1"], "bucket 0")
        assert transport.drain() == {}
    finally:
        transport.close()
    assert transport.paths == {"http://gpu:1": "staged"}


def test_an_engine_that_cannot_see_the_trainers_gpu_gets_host_memory_from_then_on(monkeypatch) -> None:
    monkeypatch.setattr("megatron_flash.weight_sync.transports.ipc.bucket_on_cuda", lambda b: True)
    monkeypatch.setattr("megatron_flash.weight_sync.transports.ipc.dumps_with_device_uuids", lambda obj: b"h")
    engines = FakeEngines({"http://other:1": "cuda"}, refuse_cuda=("http://other:1",))
    transport = transport_for(engines)
    try:
        errors = transport.send(bucket(), ["http://other:1"], "bucket 0")
        assert list(errors) == ["http://other:1"] and CANNOT_OPEN_CUDA in errors["http://other:1"]
        assert transport.send(bucket(), ["http://other:1"], "bucket 0") == {}  # the re-sync pass
        assert transport.drain() == {}
    finally:
        transport.close()
    assert transport.paths == {"http://other:1": "staged"}
    assert sum("CUDA ipc" in step for _, step, _ in engines.requests) == 1  # refused once, not asked again


class InfoOnly:
    """fan() that answers get_server_info with each engine's reported GPU; any other call is a failure."""

    def __init__(self, uuids: dict[str, str | None]) -> None:
        self.uuids, self.steps = uuids, []

    def fan(self, step: str, urls: list[str], call, **kw):
        self.steps.append(step)
        assert "get_server_info" in step, f"no group may be formed after the refusal: {step}"
        return {u: {"device": "cuda:0", "device_uuid": self.uuids[u]} for u in urls}, {}


def test_broadcast_refuses_engines_on_the_trainers_own_gpu_by_name(monkeypatch) -> None:
    """NCCL cannot hold two ranks of one group on one GPU: the transport names the engine and the fix
    before forming a group, instead of the engine's rendezvous error."""
    from megatron_flash.weight_sync.transports import broadcast
    from megatron_flash.weight_sync.transports.base import TransportContext

    monkeypatch.setattr(broadcast.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(broadcast.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(broadcast, "device_uuid", lambda index: f"GPU-{index}")
    engines = InfoOnly({"http://a": "GPU-1", "http://b": "GPU-0", "http://c": None})
    ctx = TransportContext(calls=engines, layout=SimpleNamespace(pp_rank=0), engine_tp_size=1, master_address="",
                           disk_dir="", export_hf=lambda d: None, in_service=lambda: list(engines.uuids))
    transport = broadcast.BroadcastTransport(ctx)
    bucket = [("w", torch.ones(4))]
    errors = transport.send(bucket, list(engines.uuids), "bucket 0")
    assert set(errors) == set(engines.uuids)  # the group would hold all three: none is formed
    message = errors["http://b"]
    assert "http://b" in message and "http://a" not in message and "http://c" not in message, message
    assert "own GPU" in message and "weight_sync.transport=ipc" in message, message
    assert broadcast.same_gpu_engines(["http://a", "http://c"], engines, 0) == []
