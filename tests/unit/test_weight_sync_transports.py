"""The transport registry: the config's choices are exactly the registered transports, and each
registered class says how it moves weights (the executor branches on these, not on names)."""

from __future__ import annotations

import pytest

from megatron_flash.config.schema import WEIGHT_TRANSPORTS
from megatron_flash.weight_sync.calls import EngineCalls
from megatron_flash.weight_sync.transports import REGISTRY, TransportContext, make_transport


def _ctx(disk_dir: str = "") -> TransportContext:
    return TransportContext(calls=EngineCalls(api_key=None, timeout_s=1.0, alive_timeout_s=1.0), layout=None,
                            engine_tp_size=1, master_address="127.0.0.1", disk_dir=disk_dir,
                            export_hf=lambda path: None, in_service=lambda: [])


def test_config_choices_are_the_registered_transports() -> None:
    assert set(WEIGHT_TRANSPORTS) == set(REGISTRY)


def test_each_transport_declares_how_it_moves_weights() -> None:
    assert {name: (cls.streams_buckets, cls.serial_stages, cls.one_sender_per_stage)
            for name, cls in REGISTRY.items()} == {
        "ipc": (True, False, False), "broadcast": (True, True, True), "disk": (False, False, False)}


def test_unknown_transport_and_disk_without_directory_are_refused() -> None:
    with pytest.raises(ValueError, match="weight_sync.transport must be one of ipc, broadcast, disk, got 'nccl'"):
        make_transport("nccl", _ctx())
    with pytest.raises(ValueError, match="'disk' needs a shared directory"):
        make_transport("disk", _ctx())
    exported: list[str] = []
    disk = make_transport("disk", TransportContext(**{**_ctx("/tmp/w").__dict__, "export_hf": exported.append}))
    disk.prepare(3)
    assert exported == ["/tmp/w"]
