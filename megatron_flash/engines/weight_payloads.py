"""Weight-update payloads the local engine accepts, in SGLang's formats: a checkpoint directory
(/update_weights_from_disk), a pickled tensor payload (/update_weights_from_tensor: plain list or
flattened bucket, unpickled through an allowlist), and a broadcast over the weight-update group
(/update_weights_from_distributed). Each turns into a list of (HF name, tensor) for the engine to copy.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import math
import os
import pickle
from typing import Any

import torch

from megatron_flash.engines.cuda_handles import rebuild_cuda_tensor_by_uuid


def read_disk_weights(model_path: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if load_format not in (None, "auto", "safetensors", "pt"):
        raise ValueError(f"load_format {load_format!r} is not supported by the local engine (auto, safetensors, pt)")
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if files:
        return [item for f in files for item in load_file(f).items()]
    files = sorted(glob.glob(os.path.join(model_path, "*.bin")))
    if not files:
        raise ValueError(f"no *.safetensors or *.bin weights in {model_path!r}")
    return [item for f in files for item in torch.load(f, map_location="cpu", weights_only=True).items()]


def read_tensor_payload(payload: bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a pickled payload; CUDA tensors are mappings of the trainer's memory,
    valid while they are referenced (copy them, then let go)."""
    data = safe_deserialize(payload)
    if load_format == "flattened_bucket":
        flat, metadata = data["flattened_tensor"], data["metadata"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
    if load_format in (None, "direct"):
        return [(name, t.get(0) if isinstance(t, LocalSerializedTensor) else t) for name, t in data]
    raise ValueError(f"Unknown load_format={load_format}")


def receive_broadcast(group: Any, *, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                      load_format: str | None, device: Any = "cpu") -> list[tuple[str, torch.Tensor]]:
    """One SGLang-style broadcast from rank 0 (plain: one broadcast per tensor; flattened_bucket: one
    uint8 buffer holding every tensor back to back)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    dtype_objs = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes]
    if load_format == "flattened_bucket":
        offsets, offset = [], 0
        for dtype, shape in zip(dtype_objs, shapes):
            if offset % dtype.itemsize:
                raise ValueError(f"Unaligned received tensor: byte offset {offset}, dtype {dtype}")
            size = math.prod(shape) * dtype.itemsize
            offsets.append((offset, offset + size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=group)
        return [(n, flat[a:b].view(d).reshape(s)) for n, d, s, (a, b) in zip(names, dtype_objs, shapes, offsets)]
    if load_format is None:
        named = [(n, torch.empty(s, dtype=d, device=device)) for n, d, s in zip(names, dtype_objs, shapes)]
        handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for _, t in named]
        for handle in handles:
            handle.wait()
        return named
    raise ValueError(f"Unknown load_format={load_format}")


@dataclasses.dataclass
class LocalSerializedTensor:
    """Stand-in for SGLang's LocalSerializedTensor: one serialized tensor per engine TP rank."""

    values: list

    def get(self, rank: int) -> torch.Tensor:
        return safe_deserialize(self.values[rank])


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (same fields)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Stand-in for SGLang's FlattenedTensorBucket so a pickled bucket can be rebuilt (data only)."""


_TORCH_MP = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                              "range", "set", "slice", "str", "tuple")
} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("_codecs", "encode"), ("types", "SimpleNamespace"),
    ("multiprocessing.resource_sharer", "DupFd"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    (_TORCH_MP, "rebuild_tensor"), (_TORCH_MP, "rebuild_storage_fd"), (_TORCH_MP, "rebuild_storage_filename"),
    (_TORCH_MP, "rebuild_storage_empty"), (_TORCH_MP, "rebuild_typed_storage"),
    (_TORCH_MP, "rebuild_typed_storage_child"),
}
_STAND_INS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): FlattenedTensorBucket,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    # CUDA IPC handles (the trainer's flat device buffers): the device arrives as a UUID (cuda_handles.py)
    (_TORCH_MP, "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
}


class _SafeUnpickler(pickle.Unpickler):
    """Allowlist unpickler for SGLang's MultiprocessingSerializer payloads: tensors, storages shared through
    torch.multiprocessing, dtypes and plain containers; anything else (code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def safe_deserialize(data: bytes | str) -> Any:
    if isinstance(data, str):
        import base64

        data = base64.b64decode(data, validate=True)
    return _SafeUnpickler(io.BytesIO(data)).load()


def read_peft_folder(path: str) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """/load_lora_adapter: a PEFT adapter folder's config and tensors (adapter_config.json,
    adapter_model.safetensors)."""
    import json

    from safetensors.torch import load_file

    config_path, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_path) or not os.path.isfile(weights):
        raise ValueError(f"lora_path {path!r} is not a PEFT adapter folder (adapter_config.json and "
                         "adapter_model.safetensors)")
    with open(config_path) as f:
        return json.load(f), list(load_file(weights).items())
