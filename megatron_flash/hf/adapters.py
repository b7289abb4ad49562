"""Low-rank adapters (LoRA) ⇄ PEFT's format, for any TP layout (pure torch, like layouts.py).

A LoRA module adds s·B·A to one Megatron linear W (s = alpha / rank); its parameters sit beside W's
as `lora_a` [r, in] and `lora_b` [out, r]. In PEFT's format (and SGLang's) each HF linear has its own
pair, `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r]. Megatron fuses some HF
linears, so one Megatron adapter is several PEFT ones that share A:

  Megatron module               HF modules                  A (every HF module)   B
  ----------------------------  --------------------------  --------------------  ----------------------
  self_attention.linear_qkv     q_proj, k_proj, v_proj      the one A             rows split like W (qkv)
  self_attention.linear_proj    o_proj                      A                     B
  mlp.linear_fc1                gate_proj, up_proj          the one A             rows split like W (gate_up)
  mlp.linear_fc2                down_proj                   A                     B

Each layout shards the adapter the way it shards W: for a column-parallel W (rows split over TP) B's
rows are split the same way and A is whole on every rank; for a row-parallel W (columns split) A's
columns are split and B is whole. An adapter whose q/k/v (or gate/up) A's differ cannot be fused and
is refused by name. `canonical_*` build the HF-named tensors from a seed, layout-free, so every TP ×
PP layout starts from the same adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Iterable, Mapping, Optional, Sequence

import torch

from megatron_flash.config.sections.model import LORA_TARGETS
from megatron_flash.hf.layouts import TensorReader, hf_to_shard, shards_to_hf
from megatron_flash.hf.name_maps import Rule
from megatron_flash.hf.spec import CheckpointError, HFModelSpec

# The targets' names are the config's (model.lora.targets); in its order, their modules:
TARGET_MODULES = dict(zip(LORA_TARGETS, ("self_attention.linear_qkv", "self_attention.linear_proj",
                                         "mlp.linear_fc1", "mlp.linear_fc2"), strict=True))
"""A target's Megatron module, below `decoder.layers.{layer}.`."""
HF_TARGET_MODULES = dict(zip(LORA_TARGETS, (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                            ("down_proj",)), strict=True))
"""PEFT's / SGLang's `target_modules` for each target."""
ADAPTER_PARAMS = ("lora_a", "lora_b")
PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def is_adapter_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def base_param(name: str) -> str:
    """`...linear_qkv.lora_a` → `...linear_qkv.weight`: the base weight whose name-map rule places it."""
    return name.rsplit(".", 1)[0] + ".weight"


def is_column(rule: Rule) -> bool:
    """Column-parallel base (rows of W split over TP) or row-parallel (columns split)."""
    return rule.layout != "row"


def adapter_names(hf_weights: Sequence[str], which: str) -> tuple[str, ...]:
    """HF base weight names → the adapter's HF names: `q_proj.weight` → `q_proj.lora_A.weight`."""
    suffix = {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight"}[which]
    assert all(n.endswith(".weight") for n in hf_weights), hf_weights
    return tuple(n[: -len(".weight")] + suffix for n in hf_weights)


_ROW = Rule("x", ("x",), "row")


def adapter_to_shard(which: str, rule: Rule, hf_weights: Sequence[str], reader: TensorReader, *,
                     spec: HFModelSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's `lora_a` / `lora_b` from HF-named adapter tensors (a PEFT file, or canonical ones)."""
    names = adapter_names(hf_weights, which)
    whole = (which == "lora_a") == is_column(rule)  # column: A whole, B split; row: A split, B whole
    if not whole:
        layout = rule if which == "lora_b" else _ROW
        return hf_to_shard(layout, names, reader, spec=spec, tp_rank=tp_rank, tp_size=tp_size,
                           padded_vocab_size=0)
    first = reader.read(names[0])
    for other in names[1:]:  # one fused A: PEFT holds a copy per HF module, all equal
        if not torch.equal(reader.read(other), first):
            raise CheckpointError(f"adapter tensors {names[0]} and {other} differ: megatron-flash fuses "
                                  f"{', '.join(n.split('.')[-3] for n in names)} into one linear with one A")
    return first


def shards_to_adapter(which: str, rule: Rule, hf_weights: Sequence[str], shards: Sequence[torch.Tensor], *,
                      spec: HFModelSpec) -> dict[str, torch.Tensor]:
    """Inverse of `adapter_to_shard`, given every TP rank's shard (one shard for a whole tensor)."""
    names = adapter_names(hf_weights, which)
    whole = (which == "lora_a") == is_column(rule)
    if whole:
        return {n: shards[0] for n in names}
    return shards_to_hf(rule if which == "lora_b" else _ROW, names, shards, spec=spec)


def canonical_adapter(which: str, rule: Rule, hf_weights: Sequence[str], reader: TensorReader, *,
                      rank: int, seed: int, b_std: float = 0.0) -> dict[str, torch.Tensor]:
    """Fresh HF-named adapter tensors of one Megatron adapter, from a seed and the base weights'
    shapes only: A ~ U(±1/sqrt(in)) (PEFT's and Megatron-Bridge's kaiming-uniform with a = sqrt(5)), B = 0
    (the first forward is the base model's) or, for tests, N(0, b_std)."""
    names = adapter_names(hf_weights, which)
    gen = torch.Generator().manual_seed(_site_seed(seed, hf_weights[0], which))
    if which == "lora_a":
        fan_in = reader.shape(hf_weights[0])[1]
        bound = 1.0 / math.sqrt(fan_in)
        a = torch.rand((rank, fan_in), generator=gen, dtype=torch.float32) * (2 * bound) - bound
        return {n: a for n in names}
    out = {}
    for name, weight in zip(names, hf_weights):
        shape = (reader.shape(weight)[0], rank)
        out[name] = torch.randn(shape, generator=gen) * b_std if b_std else torch.zeros(shape)
    return out


def _site_seed(seed: int, hf_weight: str, which: str) -> int:
    digest = hashlib.sha256(f"{seed}:{hf_weight}:{which}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- PEFT files

def peft_config(*, rank: int, alpha: float, dropout: float, targets: Iterable[str],
                base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a LoRA on a causal LM."""
    modules = sorted({m for t in targets for m in HF_TARGET_MODULES[t]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


def targets_of(config: Mapping) -> tuple[str, ...]:
    """The megatron-flash targets a PEFT config's target_modules cover (refused unless whole)."""
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    out = []
    for target, hf in HF_TARGET_MODULES.items():
        covered = [m in modules for m in hf]
        if all(covered):
            out.append(target)
        elif any(covered):
            raise CheckpointError(f"adapter target_modules {modules}: {', '.join(hf)} are one fused Megatron linear "
                                  f"({TARGET_MODULES[target]}); an adapter must cover all of them or none")
    unknown = [m for m in modules if not any(m in hf for hf in HF_TARGET_MODULES.values())]
    if unknown:
        raise CheckpointError(f"adapter target_modules {unknown} have no megatron-flash LoRA target "
                              f"(known: {sorted(m for hf in HF_TARGET_MODULES.values() for m in hf)})")
    return tuple(out)


PEFT_HONOURED = ("r", "lora_alpha", "target_modules", "lora_dropout")
"""adapter_config.json fields the adapter is built from (dropout: what training would use)."""
PEFT_INFORMATIONAL = ("peft_type", "peft_version", "task_type", "base_model_name_or_path", "revision",
                      "inference_mode", "auto_mapping", "init_lora_weights", "megatron_core", "qalora_group_size")
"""Fields that do not change an adapter's output once its weights are loaded (init_lora_weights: how
fresh weights would be drawn; megatron_core / qalora_group_size: only read with megatron_config /
use_qalora, which are refused)."""
PEFT_REFUSED_WHY = {
    "alpha_pattern": "a per-module lora_alpha", "rank_pattern": "a per-module rank",
    "bias": "trained biases beside the adapters", "modules_to_save": "whole modules trained beside the adapters",
    "use_dora": "DoRA's magnitude vectors", "use_rslora": "rsLoRA's alpha / sqrt(r) scale",
    "fan_in_fan_out": "transposed (Conv1D) weights", "layers_to_transform": "adapters on some layers only",
    "layers_pattern": "adapters on some layers only", "exclude_modules": "modules left out of target_modules",
    "lora_bias": "a bias on lora_B", "layer_replication": "replicated layers",
}


def check_peft_fields(config: Mapping, *, where: str) -> None:
    """Every adapter_config.json field is honoured, has no effect on a loaded adapter, or holds its
    no-op value (bias "none", anything else empty or false); otherwise CheckpointError names it, since
    loading the tensors while ignoring it would compute a different function than PEFT's."""
    for key, value in config.items():
        if key in PEFT_HONOURED or key in PEFT_INFORMATIONAL:
            continue
        if (value == "none") if key == "bias" else not value:
            continue
        why = PEFT_REFUSED_WHY.get(key, "a PEFT option this loader does not implement")
        raise CheckpointError(f"{where}: {key}={value!r} ({why}) is not honoured here: megatron-flash loads plain "
                              f"LoRA ({', '.join(PEFT_HONOURED)}); export the adapter without it, or merge it into "
                              "the base")


def read_peft_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors named without PEFT's `base_model.model.` prefix)."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(path, PEFT_CONFIG), os.path.join(path, PEFT_WEIGHTS)
    for f in (config_path, weights_path):
        if not os.path.isfile(f):
            raise CheckpointError(f"LoRA adapter {path!r}: {os.path.basename(f)} is missing")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
    check_peft_fields(config, where=config_path)
    tensors = {k.removeprefix(PEFT_PREFIX).replace(".default.", "."): v for k, v in load_file(weights_path).items()}
    return config, tensors


def write_peft_adapter(out_dir: str, tensors: Mapping[str, torch.Tensor], config: dict) -> None:
    """Write a PEFT adapter folder (tensors named without the prefix) into `out_dir`, which must not exist
    yet as a finished folder (the caller renames it into place)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.detach().clone().contiguous() for k, v in sorted(tensors.items())},  # q/k/v share A
              os.path.join(out_dir, PEFT_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, PEFT_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def base_fingerprint(model_dir: str, *, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A digest of a HF checkpoint: config.json, each safetensors header (names, shapes, dtypes,
    offsets) and `samples` evenly spaced 64 KiB windows of its tensor bytes. Other weights of the same
    shapes change it too, and it reads ~1 MiB per file. Adapters are only valid on the base they were
    trained on."""
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            digest.update(name.encode() + f.read(min(n, 100 << 20)) + str(size).encode())
            start = 8 + n
            for i in range(samples):
                f.seek(start + (size - start) * i // samples)
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]


def check_same_base(recorded: Optional[str], model_dir: str, *, what: str) -> None:
    if recorded is not None and recorded != base_fingerprint(model_dir):
        raise CheckpointError(f"{what} was trained on another base model than model.hf_path={model_dir!r} "
                              f"(base fingerprint {recorded}, this one {base_fingerprint(model_dir)})")
