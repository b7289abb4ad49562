"""LoRA on Megatron-Core's parallel linears: the base frozen, adapters the only trained parameters.

    y = W·x + s·B·(A·x),   s = alpha / rank,   A [r, in] ~ U(±1/sqrt(in)),  B [out, r] = 0 at the start

An adapted linear keeps its class's forward for W (Megatron's frozen-weight path: no weight gradient,
no weight all-reduce) and adds the low-rank term; the adapter's tensors sit beside W as `lora_a` and
`lora_b`, so every name the name maps, checkpoints and the DDP buckets know stays as it was.
Tensor parallelism (hf/adapters.py tables the layouts) moves only r-wide activations:

  base          A           B            forward                             backward (extra)
  ------------  ----------  -----------  ----------------------------------  ------------------------------
  column (qkv,  whole       rows split   h = A·x on every rank; B_r·h        all-reduce of dh over TP
  fc1)                                   (SP: A·x_chunk, all-gather h)       (SP: reduce-scatter of dh)
  row (proj,    columns     whole        h = Σ_TP A_r·x_r (all-reduce);      none
  fc2)          split                    B·h  (SP: reduce-scatter h)

Under sequence parallelism each rank sees a chunk of the sequence, so A (column) and B (row) get
partial gradients: they carry Megatron's `sequence_parallel` flag and finalize_model_grads sums them
over TP like the norms. Split tensors carry the tensor-parallel attributes, so the gradient norm
counts each element once, at any TP.

The optimizer (the distributed one too) holds only the adapters: Megatron's DDP and optimizer skip
parameters without requires_grad. The KL reference of a run that starts from fresh adapters is the
same model with its adapters off (`adapters_off`): no second copy of the weights. Transformer Engine's
fused norm + linear layers are not adapted (refused, as are MoE experts: attention only there).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch

from megatron_flash.config.sections.model import LORA_TARGETS
from megatron_flash.hf.adapters import (
    ADAPTER_PARAMS,
    TARGET_MODULES,
    adapter_to_shard,
    canonical_adapter,
    read_peft_adapter,
    targets_of,
)
from megatron_flash.hf.io import layer_offset
from megatron_flash.hf.layouts import Layout
from megatron_flash.hf.name_maps import name_map_for
from megatron_flash.hf.spec import CheckpointError, HFModelSpec
from megatron_flash.trainer.patches import lora_linear

TARGETS = LORA_TARGETS
DENSE_ONLY = ("fc1", "fc2")  # a MoE layer's MLP is its experts: no adapters there yet


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """The adapters a policy trains (config `model.lora`); rank 0 = none."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    adapter_path: str = ""
    seed: int = 1234
    b_std: float = 0.0
    """Tests only: B drawn from N(0, b_std) instead of zeros, so a first step moves A too."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora: Any, *, seed: int) -> "LoraOptions":
        return cls(rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout), targets=tuple(lora.targets),
                   adapter_path=lora.adapter_path, seed=seed)


def check_lora(spec: HFModelSpec, options: LoraOptions, *, uses_te: bool) -> None:
    """Refuse, by name, what the adapters are not built for."""
    if not options.enabled:
        return
    unknown = [t for t in options.targets if t not in TARGETS]
    if unknown or not options.targets:
        raise ValueError(f"model.lora.targets={list(options.targets)}: each must be one of {'|'.join(TARGETS)}")
    if uses_te:
        raise ValueError("model.lora.rank > 0 with Transformer Engine's layer spec: its fused norm + linear layers "
                         "take no adapters here; set model.use_transformer_engine=false")
    experts = [t for t in options.targets if t in DENSE_ONLY]
    if spec.moe is not None and experts:
        raise ValueError(f"model.lora.targets={list(options.targets)} on {spec.architecture}: {', '.join(experts)} "
                         "would adapt the experts, which is not built; use model.lora.targets=[qkv,proj]")


def _sites(chunks: list[Any], targets: tuple[str, ...]) -> Iterator[tuple[int, str, Any]]:
    """(chunk layer offset, chunk-local name of the adapted module, module) for every target linear."""
    for chunk in chunks:
        inner = getattr(chunk, "module", chunk)
        offset = layer_offset(chunk)
        for index, layer in enumerate(inner.decoder.layers):
            for target in targets:
                name = f"decoder.layers.{index}.{TARGET_MODULES[target]}"
                yield offset, name, inner.get_submodule(name)


def apply_lora(chunks: list[Any], options: LoraOptions, *, spec: HFModelSpec, layout: Layout,
               adapter: Optional[dict[str, torch.Tensor]] = None) -> int:
    """Freeze every parameter of the model chunks (before DDP wraps them) and give each target linear
    its adapter: from `adapter` (HF-named tensors of a PEFT file) or fresh from options.seed.
    Returns the number of adapter parameters on this rank."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    name_map = name_map_for(spec)
    count = 0
    readers: list[_Reader] = []
    for offset, name, linear in _sites(chunks, options.targets):
        rule, hf_weights = name_map.resolve(name + ".weight", layer_offset=offset, tied=spec.tie_word_embeddings)
        column = rule.layout != "row"
        tp_rank, tp_size = layout.tp_rank, layout.tp_size
        source = adapter
        if source is None:  # fresh: the full shapes come from the base weight's shard
            source = {}
            shapes = _FullShapes(linear, hf_weights, rule, tp_size)
            for which in ADAPTER_PARAMS:
                source.update(canonical_adapter(which, rule, hf_weights, shapes, rank=options.rank,
                                                seed=options.seed, b_std=options.b_std))
        reader = _Reader(source, f"model.lora.adapter_path={options.adapter_path!r}")
        readers.append(reader)
        lora_linear.adapt(linear, column=column)
        weight = linear.weight
        for which in ADAPTER_PARAMS:
            shard = adapter_to_shard(which, rule, hf_weights, reader, spec=spec, tp_rank=tp_rank, tp_size=tp_size)
            param = torch.nn.Parameter(shard.to(device=weight.device, dtype=weight.dtype).contiguous())
            split = (which == "lora_b") == column
            if split:
                set_tensor_model_parallel_attributes(param, True, 1 if which == "lora_a" else 0, 1)
            if linear.sequence_parallel and not split:
                param.sequence_parallel = True  # partial gradient per sequence chunk: summed over TP
            linear.register_parameter(which, param)
            count += param.numel()
        linear.lora_gate_up = rule.layout == "gate_up"
        linear.lora_scaling = options.scaling
        linear.lora_dropout = options.dropout
        linear.lora_active = True
    if adapter is not None:
        unused = set(adapter) - _used_by_every_stage(set().union(*(r.used for r in readers)), layout)
        if unused:
            raise CheckpointError(f"model.lora.adapter_path={options.adapter_path!r}: tensor(s) "
                                  f"{sorted(unused)[:3]} match no adapted module of this model")
    return count


def _used_by_every_stage(used: set[str], layout: Layout) -> set[str]:
    """The adapter tensors some pipeline stage read: a stage reads only its own layers' tensors, so the
    check that every tensor found a module runs on the union over the PP group (the same on every rank)."""
    if layout.pp_size == 1:
        return used
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    stages: list[Any] = [None] * layout.pp_size
    dist.all_gather_object(stages, sorted(used), group=ps.get_pipeline_model_parallel_group())
    return set().union(*map(set, stages))


class _FullShapes:
    """The full (HF) shapes of a linear's base weights, read off its local shard: all `canonical_adapter`
    needs from a reader."""

    def __init__(self, linear: Any, hf_weights: tuple[str, ...], rule: Any, tp_size: int) -> None:
        out_local, in_local = linear.weight.shape
        if rule.layout == "row":
            self._shapes = {hf_weights[0]: (out_local, in_local * tp_size)}
        else:  # column: rows split over TP; fused q/k/v or gate/up rows add up per HF tensor
            self._shapes = dict(zip(hf_weights, _split_rows(rule, out_local * tp_size, hf_weights, linear)))
            self._shapes = {n: (rows, in_local) for n, rows in self._shapes.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


def _split_rows(rule: Any, rows: int, hf_weights: tuple[str, ...], linear: Any) -> list[int]:
    if rule.layout == "gate_up":
        return [rows // 2, rows // 2]
    if rule.layout == "qkv":
        config = linear.config
        d = config.kv_channels
        groups = config.num_query_groups
        heads = config.num_attention_heads
        return [heads * d, groups * d, groups * d]
    return [rows]


def load_adapter(options: LoraOptions, base_path: str) -> dict[str, torch.Tensor]:
    """The HF-named tensors of the PEFT adapter at options.adapter_path, after checking it is an
    adapter of this shape (rank, alpha, targets); apply_lora checks every tensor is used."""
    config, tensors = read_peft_adapter(options.adapter_path)
    got = (config.get("r"), float(config.get("lora_alpha", "nan")), set(targets_of(config)))
    want = (options.rank, options.alpha, set(options.targets))
    if got != want:
        raise CheckpointError(f"model.lora.adapter_path={options.adapter_path!r} has r={got[0]}, lora_alpha={got[1]}, "
                              f"targets {sorted(got[2])}; model.lora has rank={want[0]}, alpha={want[1]}, "
                              f"targets {sorted(want[2])}")
    return tensors


class _Reader:
    """A TensorReader over an adapter's tensors that names a missing one and records what was read."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        self.tensors, self.what, self.used = tensors, what, set()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        t = self._get(name)
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.what}: tensor {name!r} is missing")
        self.used.add(name)
        return self.tensors[name]


def adapter_weights_per_token(spec: HFModelSpec, options: LoraOptions) -> int:
    """Adapter weights one token multiplies through (r·(in + out) per adapted linear and layer)."""
    if not options.enabled:
        return 0
    h, f, q, kv = spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads * spec.head_dim, \
        spec.num_query_groups * spec.head_dim
    sizes = {"qkv": h + q + 2 * kv, "proj": q + h, "fc1": h + 2 * f, "fc2": f + h}
    return spec.num_layers * options.rank * sum(sizes[t] for t in options.targets)


def adapter_parameters(chunks: list[Any]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for chunk in chunks:
        inner = getattr(chunk, "module", chunk)
        for name, param in inner.named_parameters():
            if name.rsplit(".", 1)[-1] in ADAPTER_PARAMS:
                yield name, param


@contextlib.contextmanager
def adapters_off(chunks: list[Any]) -> Iterator[None]:
    """The base model's forward (the KL reference of fresh adapters), adapters untouched."""
    modules = [m for chunk in chunks for m in chunk.modules() if hasattr(m, "lora_active")]
    for m in modules:
        m.lora_active = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_active = True


def require_input_grad(chunks: list[Any]) -> None:
    """Full recompute re-runs checkpointed layers only for inputs that need a gradient; with the
    embedding frozen the first stage's hidden states need none, and the adapters inside those layers
    would get no gradient at all. The embedding's output asks for one (as PEFT's
    enable_input_require_grads does)."""
    for chunk in chunks:
        inner = getattr(chunk, "module", chunk)
        embedding = getattr(inner, "embedding", None)
        if embedding is not None and getattr(inner, "pre_process", False):
            embedding.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))


def adapter_checkpoint_keys(state: dict) -> dict:
    """The adapters' entries of a model chunk's (sharded) state dict."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in ADAPTER_PARAMS}


