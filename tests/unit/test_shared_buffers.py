"""Staged ipc, both ends in one process: the trainer's SharedBuffers + Stager hand buffers to the
engine's SharedBufferMaps (opened through /proc/<pid>/fd, as an engine does) and copy_pieces writes
them into the receiver's tensors. Expected values are the source tensors themselves."""

from __future__ import annotations


import pytest
import torch

from megatron_flash.engines.shared_weights import SharedBufferMaps, copy_pieces
from tests.conftest import memfd_links
from megatron_flash.weight_sync.transports.shared_buffers import SharedBuffers, Stager


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.fp32": torch.randn(37, 11, generator=gen),                       # 1628 B: not a multiple of anything
        "b.bf16": torch.randn(301, generator=gen).to(torch.bfloat16),
        "c.big": torch.randn(64, 64, generator=gen),                        # 16 KB > the 4000-byte buffers
        "d.int64": torch.randint(-2**40, 2**40, (129,), generator=gen),
        "e.t": torch.randn(24, 9, generator=gen).t(),                       # not contiguous
        "f.bf16big": torch.randn(3000, generator=gen).to(torch.bfloat16),   # 6 KB, bf16 pieces
        "g.bool": torch.rand(77, generator=gen) > 0.5,
        "h.scalar": torch.tensor(3.25),
    }


class Receiver:
    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        self.maps = SharedBufferMaps()
        self.tensors = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in like.items()}
        self.requests: list[tuple[int, int]] = []
        self.fail_at: int | None = None
        self.bad_calls = 0
        self.targets: list[list[str]] = []

    def deliver(self, spec: dict, entries: list, urls: list, label: str) -> dict:
        self.requests.append((spec["index"], len(entries)))
        self.targets.append(list(urls))
        if [u for u in urls if u != "bad"]:  # one receiver stands for the healthy engines
            copy_pieces(self.maps.pieces({"buffer": spec, "tensors": entries}), self.tensors.get)
        if self.fail_at is not None and len(self.requests) - 1 >= self.fail_at:
            self.bad_calls += "bad" in urls
            return {u: f"{label}: boom" for u in urls if u == "bad"}
        return {}


@pytest.mark.parametrize("buffer_bytes,count", [(4000, 2), (4000, 3), (1 << 20, 2), (64, 2)])
def test_every_byte_arrives_across_buffers_pieces_and_dtypes(buffer_bytes: int, count: int) -> None:
    src = state()
    rx = Receiver(src)
    stager = Stager(rx.deliver, SharedBuffers(buffer_bytes, count))
    try:
        for sync in range(2):  # the second sync reuses the same buffers and mappings
            sent = {n: t + sync if t.dtype not in (torch.bool,) else ~t if sync else t for n, t in src.items()}
            items = list(sent.items())
            for i in range(0, len(items), 3):  # buckets of three tensors, as hf_buckets yields them
                assert stager.add(items[i:i + 3], ["engine"], f"bucket {i // 3}") == {}
            assert stager.drain() == {}
            for name, t in sent.items():
                assert torch.equal(rx.tensors[name], t), name
            assert rx.maps.mapped == min(count, len(rx.requests))
        assert {i for i, _ in rx.requests} == set(range(min(count, len(rx.requests))))
        if buffer_bytes < 64 * 64 * 4:
            assert len(rx.requests) > 2 * len(src) // 3  # large tensors went in pieces
    finally:
        stager.close()
        rx.maps.close()
    assert memfd_links() == []  # the buffers' file descriptors are closed


def test_a_failed_engine_gets_no_later_buffer_and_is_reported_once() -> None:
    src = state()
    rx = Receiver(src)
    rx.fail_at = 1
    stager = Stager(rx.deliver, SharedBuffers(4000, 2))
    try:
        errors: dict = {}
        items = list(src.items())
        for i in range(0, len(items), 2):
            for url, message in stager.add(items[i:i + 2], ["good", "bad"], f"bucket {i // 2}").items():
                assert url not in errors
                errors[url] = message
        for url, message in stager.drain().items():
            assert url not in errors
            errors[url] = message
        assert list(errors) == ["bad"] and errors["bad"].endswith(": boom")
        # after its failure is known no buffer goes to it; one more may already be in flight
        assert 1 <= rx.bad_calls <= 2
        assert "bad" not in rx.targets[-1]
        assert errors["bad"].startswith("bucket ")  # names the buckets the failed buffer held
        for name, t in src.items():  # the healthy engine got everything
            assert torch.equal(rx.tensors[name], t), name
        # a new pass starts clean: the engine that failed is a target again
        rx.fail_at = None
        assert stager.add(items[:1], ["good", "bad"], "bucket 0") == {}
        assert stager.drain() == {}
        assert rx.targets[-1] == ["good", "bad"]
    finally:
        stager.close()
        rx.maps.close()


def test_buffers_too_small_for_any_element_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one of >= 64 bytes"):
        SharedBuffers(16)


def test_the_engine_side_refuses_bad_requests_by_field() -> None:
    buffers = SharedBuffers(1024, 1)
    maps = SharedBufferMaps()
    try:
        spec = buffers.spec(0)
        good = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "start": 0, "numel": 4}
        assert maps.pieces({"buffer": spec, "tensors": [good]})[0].source.numel() == 4
        cases = [
            ({**good, "dtype": "float99"}, "dtype 'float99'"),
            ({**good, "offset": 1022}, "beyond the buffer"),
            ({**good, "offset": 2}, "not aligned"),
            ({**good, "start": 2}, "beyond its shape"),
            ({**good, "numel": 0}, "numel must be an integer >= 1"),
            ({k: v for k, v in good.items() if k != "shape"}, "needs the fields"),
        ]
        for entry, said in cases:
            with pytest.raises(ValueError, match="tensors\\[0\\]") as info:
                maps.pieces({"buffer": spec, "tensors": [entry]})
            assert said in str(info.value), (entry, str(info.value))
        with open(__file__) as f:  # a descriptor that is not one of the trainer's buffers
            with pytest.raises(ValueError, match="not a mf-weights shared-memory file"):
                SharedBufferMaps().buffer({**spec, "set": "other", "fd": f.fileno()})
        with pytest.raises(ValueError, match="trainer process is gone"):
            SharedBufferMaps().buffer({**spec, "set": "other", "fd": 99999})
        with pytest.raises(ValueError, match="unknown parameter 'w'"):
            copy_pieces(maps.pieces({"buffer": spec, "tensors": [good]}), {}.get)
        with pytest.raises(ValueError, match="shape of w"):
            copy_pieces(maps.pieces({"buffer": spec, "tensors": [good]}), {"w": torch.zeros(5)}.get)
    finally:
        maps.close()
        buffers.close()


def test_an_engine_that_cannot_map_the_buffers_falls_back_to_the_pickled_path() -> None:
    """An engine on another host or PID namespace answers that it cannot open the buffer: its
    re-sync (and every later sync) goes through the pickled path instead of failing again."""
    from types import SimpleNamespace

    from megatron_flash.weight_sync.transports.base import TransportContext
    from megatron_flash.weight_sync.transports.ipc import IpcTransport

    calls_seen: list[str] = []

    def fan(step, urls, call, **kw):
        calls_seen.append(step)
        if "get_server_info" in step:
            return {u: {"weight_update_shared_memory": True} for u in urls}, {}
        if "shared_memory" in step:
            return {}, {u: f"{step}: EngineHTTPError: HTTP 400: buffer /proc/1/fd/3: cannot be opened (No such "
                           "file or directory): the trainer process is gone or on another host (ipc needs engines "
                           "on the trainer's host)" for u in urls}
        return {u: {} for u in urls}, {}

    ctx = TransportContext(calls=SimpleNamespace(fan=fan), layout=None, engine_tp_size=1, master_address="",
                           disk_dir="", export_hf=lambda d: None, in_service=lambda: ["http://far:1"],
                           bucket_bytes=4096, sender_bytes_bound=1 << 20)
    transport = IpcTransport(ctx)
    try:
        transport.prepare(1)
        bucket = [("w", torch.ones(8))]
        transport.send(bucket, ["http://far:1"], "PP stage 0 bucket 0")
        errors = transport.drain()
        assert list(errors) == ["http://far:1"]
        transport.send(bucket, ["http://far:1"], "PP stage 0 bucket 0")  # the re-sync pass
        assert transport.drain() == {}
        assert [s for s in calls_seen if "bucket" in s] == [
            "PP stage 0 bucket 0 (update_weights_from_shared_memory)", "PP stage 0 bucket 0 (update_weights_from_tensor)"]
    finally:
        transport.close()
