"""HF safetensors ⇄ Megatron shards, for any TP/PP layout.

Import: every rank opens the checkpoint lazily and reads, for each of its own parameters, only the
rows/columns its shard needs (safetensors slices), through the family's name map.
Export: within each PP stage the TP shards are all-gathered per parameter and turned back into HF
tensors (vocab padding stripped); the stage's (TP 0, DP 0) rank writes one safetensors file, and
global rank 0 writes the index, config and tokenizer, then renames the folder into place — so a
crash leaves no half-written checkpoint at the destination. Multi-node export needs `out_dir` on a
shared filesystem.

MoE experts are split over expert-parallel ranks (each holds num_experts / EP of them) and each
expert over the expert-tensor-parallel group. An expert's tensors are gathered over that group only
and leave from the rank that owns them (expert-TP 0, expert-DP 0 of its EP rank): nothing gathers
every expert on one rank. Under EP each stage writes one file per EP rank.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_flash.hf.adapters import base_param, is_adapter_param, is_column, shards_to_adapter, write_peft_adapter
from megatron_flash.hf.spec import CheckpointError, HFModelSpec
from megatron_flash.hf.layouts import Layout, hf_to_shard, shards_to_hf
from megatron_flash.hf.name_maps import name_map_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


class SafetensorsReader:
    """Lazy, slice-reading access to a HF checkpoint's tensors (single file or sharded with index)."""

    def __init__(self, model_dir: str) -> None:
        from safetensors import safe_open

        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))
            weight_map = {}
        if not files:
            raise CheckpointError(f"no *.safetensors files in HF checkpoint directory {model_dir!r}")
        self._handles: dict[str, Any] = {}
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{index}: lists {name!r}, which does not exist")
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error type for a corrupt header
                raise CheckpointError(f"cannot read safetensors file {path!r}: {e}") from None
            self._handles[name] = handle
            if not weight_map or not os.path.isfile(index):
                for key in handle.keys():
                    weight_map[key] = name
        self.model_dir = model_dir
        self.weight_map = weight_map

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from HF checkpoint {self.model_dir!r}")
        try:
            return self._handles[self.weight_map[name]].get_slice(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.weight_map[name]!r}: {e}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        sl = self._slice(name)
        try:
            if rows is None and cols is None:
                return sl[:]
            if cols is None:
                return sl[rows]
            return sl[rows if rows is not None else slice(None), cols]
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.weight_map[name]!r}: {e}") from None


def _chunk_params(model: Any, *, merged: bool = False) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(global index of the chunk's first layer, name, parameter) over a model or a list of model
    chunks (interleaved pipeline); Megatron's DDP wrapper is looked through.

    LoRA (trainer/lora.py): an adapted linear's `lora_a` / `lora_b` have no HF name and are skipped;
    with `merged` its weight is the module's `lora_merged_weight()`, W + s·B·A, a new tensor."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        offset = layer_offset(chunk)
        inner = getattr(chunk, "module", chunk)
        seen: set[int] = set()
        for module_name, module in inner.named_modules():
            for short, param in module.named_parameters(recurse=False):
                if id(param) in seen or is_adapter_param(short):
                    continue
                seen.add(id(param))
                name = f"{module_name}.{short}" if module_name else short
                if merged and short == "weight" and hasattr(module, "lora_merged_weight"):
                    yield offset, name, module.lora_merged_weight()
                else:
                    yield offset, name, param


def layer_offset(chunk: Any) -> int:
    """Global index of a model chunk's first layer (chunks number their layers from 0): Megatron's
    own rule, so interleaved chunks (layers v·P·n + p·n … for pipeline rank p, virtual stage v, n
    layers per chunk) come out the way the schedule runs them."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    inner = getattr(chunk, "module", chunk)  # under Megatron's DDP wrapper
    return get_transformer_layer_offset(inner.config, vp_stage=inner.vp_stage)


def expert_offset(spec: HFModelSpec, layout: Layout) -> int:
    """Global index of this expert-parallel rank's first expert."""
    return 0 if spec.moe is None else layout.ep_rank * (spec.moe.num_experts // layout.ep_size)


def _shard_rank(rule: Any, layout: Layout) -> tuple[int, int]:
    """(rank, size) of the group a parameter is split over: expert-TP for experts, else TP."""
    return (layout.etp_rank, layout.etp_size) if rule.is_expert else (layout.tp_rank, layout.tp_size)


def owns(rule: Any, layout: Layout) -> bool:
    """Is this rank the one that hands out the parameter's full HF tensors (export, weight sync)?"""
    if rule.is_expert:
        return layout.etp_rank == 0 and layout.edp_rank == 0 and layout.cp_rank == 0
    return layout.tp_rank == 0 and layout.dp_rank == 0 and layout.cp_rank == 0  # replicated over CP


def _resolve(name_map: Any, name: str, offset: int, spec: HFModelSpec, layout: Layout) -> tuple[Any, tuple[str, ...]]:
    return name_map.resolve(name, layer_offset=offset, tied=spec.tie_word_embeddings,
                            expert_offset=expert_offset(spec, layout))


def load_hf_weights(model: Any, model_dir: str, *, spec: HFModelSpec, layout: Layout,
                    padded_vocab_size: int) -> list[str]:
    """Copy this rank's shard of every parameter (of a model or its chunks) from the HF checkpoint.
    Returns the HF names read."""
    reader = SafetensorsReader(model_dir)
    name_map = name_map_for(spec)
    used: list[str] = []
    for offset, name, param in _chunk_params(model):
        rule, hf_names = _resolve(name_map, name, offset, spec, layout)
        rank, size = _shard_rank(rule, layout)
        shard = hf_to_shard(rule, hf_names, reader, spec=spec, tp_rank=rank, tp_size=size,
                            padded_vocab_size=padded_vocab_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{model_dir}: {', '.join(hf_names)} gives shape {tuple(shard.shape)} for Megatron "
                f"parameter {name!r}, which expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(shard.to(dtype=param.dtype, device=param.device))
        used.extend(hf_names)
    return used


def _gather(tensor: torch.Tensor, rule: Any, layout: Layout) -> list[torch.Tensor]:
    """Every shard of a parameter, in rank order, over the group it is split over."""
    _, size = _shard_rank(rule, layout)
    if size == 1:
        return [tensor]
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_parallel_group() if rule.is_expert else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def stage_hf_tensors(model: Any, *, spec: HFModelSpec, layout: Layout,
                     gather_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) of this PP stage's parameters (every chunk of it under
    interleaving) that this rank owns (`owns`): the stage's TP 0 / DP 0 rank the dense ones, each EP
    rank's expert-TP 0 / expert-DP 0 rank its experts. `gather_experts`: every expert goes to the
    stage's dense owner instead (all-gathered over the EP group). Every rank of the stage must
    iterate (the shards are gathered by collectives)."""
    name_map = name_map_for(spec)
    for offset, name, param in _chunk_params(model, merged=True):
        rule, hf_names = _resolve(name_map, name, offset, spec, layout)
        if spec.tie_word_embeddings and name == "output_layer.weight":
            continue  # the first stage's embedding is the tied copy we export
        shards = [param.detach()] if rule.layout == "replicated" else _gather(param.detach(), rule, layout)
        if rule.is_expert and gather_experts and layout.ep_size > 1:
            # every rank joins the EP all-gather; the stage's dense owner yields
            yield from _gather_experts(name_map, name, offset, shards_to_hf(rule, hf_names, shards, spec=spec),
                                       spec=spec, layout=layout)
        elif owns(rule, layout):
            yield from shards_to_hf(rule, hf_names, shards, spec=spec).items()


def _gather_experts(name_map: Any, name: str, offset: int, tensors: dict[str, torch.Tensor], *,
                    spec: HFModelSpec, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert's HF tensors from every EP rank, yielded (under each rank's global expert
    names) on the stage's dense owner."""
    from megatron.core import parallel_state as ps

    per_rank = spec.moe.num_experts // layout.ep_size
    gathered: dict[str, list[torch.Tensor]] = {}
    for hf_name, tensor in tensors.items():
        parts = [torch.empty_like(tensor) for _ in range(layout.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
        gathered[hf_name] = parts
    if not (layout.tp_rank == 0 and layout.dp_rank == 0 and layout.cp_rank == 0):
        return
    for ep in range(layout.ep_size):
        _, names = name_map.resolve(name, layer_offset=offset, tied=spec.tie_word_embeddings,
                                    expert_offset=ep * per_rank)
        for local_name, global_name in zip(tensors, names):
            yield global_name, gathered[local_name][ep]


def stage_adapter_tensors(model: Any, *, spec: HFModelSpec, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF adapter name, full tensor) of this PP stage's LoRA adapters on the stage's TP 0 / DP 0
    rank (hf/adapters.py names and lays them out). Every rank of the stage must iterate (split tensors
    are all-gathered over TP)."""
    name_map = name_map_for(spec)
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        offset = layer_offset(chunk)
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            if not is_adapter_param(name):
                continue
            which = name.rsplit(".", 1)[1]
            rule, hf_weights = _resolve(name_map, base_param(name), offset, spec, layout)
            whole = (which == "lora_a") == is_column(rule)
            shards = [param.detach()] if whole else _gather(param.detach(), rule, layout)
            if owns(rule, layout):
                yield from shards_to_adapter(which, rule, hf_weights, shards, spec=spec).items()


def gather_adapter(model: Any, *, spec: HFModelSpec, layout: Layout) -> dict[str, torch.Tensor]:
    """Every stage's adapter tensors (HF-named, host copies) on global rank 0; {} elsewhere. Collective.
    Adapters are megabytes: one object gather, no buckets."""
    local = {k: v.to(device="cpu", copy=True).contiguous() for k, v in stage_adapter_tensors(model, spec=spec, layout=layout)}
    if layout.world_size == 1:
        return local
    parts: list[Any] = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    out: dict[str, torch.Tensor] = {}
    for part in parts or []:
        out.update(part)
    return out


def export_adapter(model: Any, out_dir: str, *, spec: HFModelSpec, layout: Layout, config: dict) -> None:
    """Write the LoRA adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors),
    renamed into place when whole. Collective."""
    tensors = gather_adapter(model, spec=spec, layout=layout)
    if layout.rank == 0:
        out_dir = os.path.abspath(out_dir)
        partial = out_dir + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_peft_adapter(partial, tensors, config)
        replace_dir(partial, out_dir)
    dist.barrier()


def export_hf(model: Any, out_dir: str, *, spec: HFModelSpec, layout: Layout,
              source_dir: str, dtype: Optional[torch.dtype] = None, adapter_config: Optional[dict] = None) -> None:
    """Write a HF checkpoint (sharded by PP stage) readable by transformers and by `load_hf_weights`.
    With LoRA the weights are merged (W + s·B·A) and `adapter_config` (PEFT's) adds the adapter alone
    as a PEFT folder `adapter/` inside it, renamed into place together."""
    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)
    partial = out_dir + ".partial"
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()

    # copy=True: at TP1 the HF tensors may be views of the parameters (and of each other: gate/up)
    tensors = {k: v.to(device="cpu", dtype=dtype or v.dtype, copy=True).contiguous()
               for k, v in stage_hf_tensors(model, spec=spec, layout=layout)}
    # One file per (PP stage, EP rank): the stage's dense tensors go with EP rank 0's experts.
    files = layout.pp_size * layout.ep_size
    file_name = f"model-{layout.pp_rank * layout.ep_size + layout.ep_rank + 1:05d}-of-{files:05d}.safetensors"
    writer = bool(tensors)
    if writer:
        save_file(tensors, os.path.join(partial, file_name), metadata={"format": "pt"})
    names = {k: file_name for k in tensors} if writer else {}
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, names)
    if adapter_config is not None:
        adapter = gather_adapter(model, spec=spec, layout=layout)
        if layout.rank == 0:
            write_peft_adapter(os.path.join(partial, "adapter"), adapter, adapter_config)

    if layout.rank == 0:
        weight_map: dict[str, str] = {}
        for part in gathered:
            weight_map.update(part)
        total = 0
        for f in sorted(set(weight_map.values())):
            total += os.path.getsize(os.path.join(partial, f))
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(source_dir, "config.json")) as f:
            config = json.load(f)
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
            config.pop("dtype", None)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in TOKENIZER_FILES:
            src = os.path.join(source_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(partial, name))
        replace_dir(partial, out_dir)
    dist.barrier()


def point_latest(root: str, name: str) -> None:
    """`root/latest` → `name` (a relative symlink), swapped atomically; leftovers of exports cut by
    a kill (`*.partial`, `*.old`, a temporary link) are removed."""
    for entry in os.listdir(root):
        if entry.endswith((".partial", ".old")) or entry.startswith(".latest."):
            path = os.path.join(root, entry)
            if os.path.islink(path) or not os.path.isdir(path):
                os.remove(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
    tmp = os.path.join(root, f".latest.{os.getpid()}")
    os.symlink(name, tmp)
    os.replace(tmp, os.path.join(root, "latest"))


def replace_dir(partial: str, out: str) -> None:
    """Move a finished `partial` directory to `out`, replacing what was there: the old one is renamed
    aside first and removed last, so `out` is never half-written."""
    old = out + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)
