"""Adapter pushes by name, their pure pieces: versioned names, whose label a reply gets, and what the
adapter transport asks the engines (a recording stand-in for the HTTP calls; the real calls are
tested in tests/contract/test_lora_adapters.py and tests/e2e/test_lora_pipeline.py)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from megatron_flash.engines.client_replies import (
    GenerateResult,
    WeightVersionSpan,
    label_by_adapter,
    lora_adapter_name,
    lora_adapter_version,
)
from megatron_flash.weight_sync.transports.adapter import AdapterTransport
from megatron_flash.weight_sync.transports.base import TransportContext


def test_names_carry_the_version() -> None:
    assert lora_adapter_name(7) == "policy-v7" and lora_adapter_version("policy-v7") == 7
    assert lora_adapter_version("policy-vdefault") == 0  # SGLang's initial label names version 0
    assert lora_adapter_version("/ckpt/adapter") is None and lora_adapter_version("policy-vx") is None


def _result(meta: dict) -> GenerateResult:
    return GenerateResult(rid="r", output_ids=[1, 2], output_logprobs=[-1.0, -2.0], finish_reason="stop",
                          weight_version="9", weight_version_spans=[WeightVersionSpan("8", 0, 1), WeightVersionSpan("9", 1, 2)],
                          meta_info=meta)


def test_label_comes_from_the_name_unless_the_engine_says_what_it_ran() -> None:
    sglang = label_by_adapter(_result({"weight_version": "9"}), "policy-v7")  # SGLang: ran the named adapter
    assert (sglang.weight_version, sglang.weight_version_spans) == ("7", None)
    local = label_by_adapter(_result({"weight_version": "9", "lora_path": "policy-v9"}), "policy-v7")
    assert local.weight_version == "9" and [s.version for s in local.weight_version_spans] == ["8", "9"]


class Recorder:
    """EngineCalls' fan(): records (step, urls) and answers per url from `fail` (url → message)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.fail: dict[str, dict[str, str]] = {}  # step prefix → url → error

    def fan(self, step: str, urls: Any, call: Any, **_: Any) -> tuple[dict, dict]:
        urls = list(urls)
        self.calls.append((step, urls))
        errors = {}
        for prefix, by_url in self.fail.items():
            if step.startswith(prefix):
                errors.update({u: f"{step}: {m}" for u, m in by_url.items() if u in urls})
        return {u: None for u in urls if u not in errors}, errors


def _transport(tmp_path: Any, via: str, urls: list[str]) -> tuple[AdapterTransport, Recorder]:
    calls = Recorder()
    ctx = TransportContext(calls=calls, layout=types.SimpleNamespace(rank=0), engine_tp_size=1,
                           master_address="127.0.0.1", disk_dir=str(tmp_path), export_hf=lambda p: None,
                           in_service=lambda: urls)
    tensors = {"model.layers.0.self_attn.o_proj.lora_A.weight": torch.ones(2, 4),
               "model.layers.0.self_attn.o_proj.lora_B.weight": torch.zeros(4, 2)}
    return AdapterTransport(ctx, via=via, gather=lambda: dict(tensors), config={"r": 2, "lora_alpha": 4}), calls


def test_a_push_loads_the_new_name_then_sets_the_version_and_unloads_two_back(tmp_path) -> None:
    urls = ["http://a", "http://b"]
    t, calls = _transport(tmp_path, "disk", urls)
    for version in (1, 2, 3):
        t.prepare(version)
        assert t.load(version, urls) == {}
    steps = [s for s, _ in calls.calls]
    assert steps == ["load_lora_adapter(policy-v1)", "update_weight_version",
                     "load_lora_adapter(policy-v2)", "update_weight_version",
                     "unload_lora_adapter(policy-v1)", "load_lora_adapter(policy-v3)", "update_weight_version"]
    assert t.loaded == {u: ["policy-v2", "policy-v3"] for u in urls}
    assert t.loaded_bytes == (8 + 8) * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2", "policy-v3"]  # older folders removed
    assert (tmp_path / "policy-v3" / "adapter_model.safetensors").is_file()


def test_a_name_already_on_an_engine_is_replaced_and_a_failed_load_sets_no_version(tmp_path) -> None:
    urls = ["http://a", "http://b"]
    t, calls = _transport(tmp_path, "ipc", urls)
    t.prepare(1)
    calls.fail = {"load_lora_adapter_from_tensors": {"http://a": "HTTP 400: ... because it is already loaded"}}
    errors = t.load(1, urls)
    # a was told to unload the stale copy and load again (still refused here: the stand-in keeps failing)
    assert [s for s, _ in calls.calls][:3] == ["load_lora_adapter_from_tensors(policy-v1)",
                                             "unload_lora_adapter(policy-v1) left by someone else",
                                             "load_lora_adapter_from_tensors(policy-v1)"]
    assert set(errors) == {"http://a"}
    assert calls.calls[-1] == ("update_weight_version", ["http://b"])  # only where the adapter landed
    assert t.loaded == {"http://b": ["policy-v1"]}
    t.forget(["http://b"])  # restarted: it holds none of ours
    assert t.loaded == {}


def test_only_ipc_or_disk() -> None:
    with pytest.raises(ValueError, match="by ipc or disk, not 'broadcast'"):
        AdapterTransport(types.SimpleNamespace(layout=types.SimpleNamespace(rank=0), disk_dir=""), via="broadcast",
                         gather=dict, config={})


def test_engines_are_started_to_serve_adapters(tmp_path) -> None:
    from megatron_flash.config import load_config
    from megatron_flash.config.schema import EngineConfig
    from megatron_flash.controller.assembly import first_sync_needed, lora_serving
    from megatron_flash.engines.launcher import EngineLauncher

    cfg = load_config(None, ["model.hf_path=/m", "model.lora.rank=8", "model.lora.targets=[qkv,fc2]"])
    serving = lora_serving(cfg)
    assert serving == {"rank": 8, "target_modules": ["down_proj", "k_proj", "q_proj", "v_proj"]}
    assert first_sync_needed(cfg)  # adapters by name are named from version 0 on
    merged = load_config(None, ["model.hf_path=/m", "model.lora.rank=8", "weight_sync.lora=merged"])
    assert lora_serving(merged) is None and not first_sync_needed(merged)

    def argv(backend: str) -> list[str]:
        return EngineLauncher.from_config(EngineConfig(backend=backend), model_path="/m", run_dir=str(tmp_path),
                                          lora_adapters=serving).specs()[0].argv

    sglang = argv("sglang")
    assert "--enable-lora" in sglang and sglang[sglang.index("--max-lora-rank") + 1] == "8"
    i = sglang.index("--lora-target-modules")
    assert list(sglang[i + 1:i + 5]) == ["down_proj", "k_proj", "q_proj", "v_proj"]
    local = argv("local")
    assert "--enable-lora" in local and "--max-lora-rank" not in local
