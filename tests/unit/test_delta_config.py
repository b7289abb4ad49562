"""weight_sync.delta and engines.dtype at config load: what each setting resolves to or why it is refused
(docs/weight_sync.md "Delta pushes"), and the dtype flag a launched engine gets."""

from __future__ import annotations

import pytest

from megatron_flash.config import load_config
from megatron_flash.engines.launcher import engine_server_args

BASE = ["model.hf_path=/unused", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16"]


@pytest.mark.parametrize("delta,transport,expected", [
    ("auto", "ipc", "off"), ("auto", "broadcast", "auto"), ("auto", "disk", "auto"),
    ("on", "ipc", "on"), ("on", "broadcast", "on"), ("off", "broadcast", "off")])
def test_what_the_bridge_is_told(delta: str, transport: str, expected: str) -> None:
    cfg = load_config(None, BASE + [f"weight_sync.delta={delta}", f"weight_sync.transport={transport}"])
    assert cfg.delta_sync() == expected


def test_defaults() -> None:
    cfg = load_config(None, BASE)
    assert (cfg.weight_sync.delta, cfg.weight_sync.delta_anchor_every, cfg.weight_sync.delta_max_density) == ("auto", 20, 0.5)
    assert cfg.engines.dtype == "" and cfg.delta_sync() == "off"  # the default transport is ipc


@pytest.mark.parametrize("override,message", [
    ("weight_sync.delta=maybe", "weight_sync.delta"),
    ("weight_sync.delta_anchor_every=-1", "weight_sync.delta_anchor_every"),
    ("weight_sync.delta_max_density=0", "weight_sync.delta_max_density must be in"),
    ("weight_sync.delta_max_density=1.5", "weight_sync.delta_max_density must be in"),
    ("engines.dtype=int8", "engines.dtype"),
])
def test_bad_values_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, BASE + [override])


def test_refusals_that_name_the_conflict() -> None:
    with pytest.raises(ValueError, match="weight_sync.delta=on with engines.colocate=true"):
        load_config(None, BASE + ["weight_sync.delta=on", "engines.colocate=true", "async_rl.alpha=0"])
    with pytest.raises(ValueError, match="weight_sync.delta=on with weight_sync.lora=adapter"):
        load_config(None, BASE + ["weight_sync.delta=on", "model.lora.rank=4", "weight_sync.lora=adapter"])
    with pytest.raises(ValueError, match="weight_sync.delta=on with engines.backend=sglang"):
        load_config(None, BASE + ["weight_sync.delta=on", "engines.backend=sglang"])
    with pytest.raises(ValueError, match="engines.server_args must not set dtype when engines.dtype=bfloat16"):
        load_config(None, BASE + ["engines.dtype=bfloat16", "engines.server_args={dtype: float32}"])
    attached = load_config(None, BASE + ["engines.dtype=bfloat16", "engines.backend=attach",
                                         "engines.urls=[http://127.0.0.1:1]"])
    assert attached.engines.dtype == "bfloat16"  # what the servers were started with: pushes are cast to it


def test_auto_stays_off_where_a_delta_cannot_apply() -> None:
    colocated = load_config(None, BASE + ["engines.colocate=true", "async_rl.alpha=0", "weight_sync.transport=broadcast"])
    assert colocated.delta_sync() == "off"
    adapters = load_config(None, BASE + ["model.lora.rank=4", "weight_sync.lora=adapter", "weight_sync.transport=disk"])
    assert adapters.delta_sync() == "off"
    merged = load_config(None, BASE + ["model.lora.rank=4", "weight_sync.lora=merged", "weight_sync.transport=disk"])
    assert merged.delta_sync() == "auto"


def test_engines_get_the_dtype_flag_only_when_it_is_set() -> None:
    cfg = load_config(None, BASE + ["engines.dtype=bfloat16"])
    assert engine_server_args(cfg.engines, backend="local")["dtype"] == "bfloat16"
    assert "dtype" not in engine_server_args(load_config(None, BASE).engines, backend="local")


def test_the_probe_threshold_follows_the_engine_dtype() -> None:
    assert load_config(None, BASE).probe_threshold() == 0.05
    assert load_config(None, BASE + ["engines.dtype=bfloat16"]).probe_threshold() == 0.3
    assert load_config(None, BASE + ["engines.dtype=bfloat16", "model.dtype=bfloat16"]).probe_threshold() == 0.05
    assert load_config(None, BASE + ["engines.dtype=bfloat16", "weight_sync.probe_threshold=0.1"]).probe_threshold() == 0.1
    with pytest.raises(ValueError, match="weight_sync.probe_threshold must be > 0"):
        load_config(None, BASE + ["weight_sync.probe_threshold=0"])


def test_delta_knobs_are_refused_where_deltas_are_off() -> None:
    with pytest.raises(ValueError, match="weight_sync.delta_anchor_every is only used with delta pushes"):
        load_config(None, BASE + ["weight_sync.delta_anchor_every=5"])  # auto over ipc: off
    with pytest.raises(ValueError, match="weight_sync.delta_max_density is only used with delta pushes"):
        load_config(None, BASE + ["weight_sync.delta=off", "weight_sync.transport=disk", "weight_sync.delta_max_density=0.2"])
    cfg = load_config(None, BASE + ["weight_sync.transport=broadcast", "weight_sync.delta_anchor_every=5"])
    assert cfg.weight_sync.delta_anchor_every == 5
