"""The policy checkpoint and its numerics (`model`), its LoRA adapters (`model.lora`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from megatron_flash.config.sections.base import _Section

DTYPES = ("float32", "bfloat16", "float16")
TRI_STATE = ("auto", "true", "false")
ATTENTION_BACKENDS = ("auto", "flash", "local")
MOE_DISPATCHERS = ("auto", "allgather", "alltoall")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""LoRA targets (model.lora.targets), defined here only: attention's fused q/k/v, its output projection,
the SwiGLU gate/up and the MLP's down projection (hf/adapters.py maps each to its modules)."""


@dataclass
class LoraConfig(_Section):
    _section: ClassVar[str] = "model.lora"

    rank: int = 0
    """Rank r of the low-rank adapters (LoRA): the base model is frozen and only the adapters train;
    0 = full fine-tuning. The other fields of this section are refused while it is 0."""
    alpha: float = 32.0
    """LoRA alpha: the adapters' output is scaled by alpha / rank (Megatron-Bridge's and PEFT's rule)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in the training forward only (π_prox, the reference and the
    engines never drop), in [0, 1)."""
    targets: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Megatron modules that get adapters: qkv (attention's fused q/k/v), proj (attention output),
    fc1 (SwiGLU gate/up), fc2 (MLP down); [all] = every one of them. MoE models: qkv and proj only."""
    adapter_path: str = ""
    """Start from this PEFT adapter (adapter_config.json + adapter_model.safetensors, e.g. one the
    run exported) instead of fresh adapters; its rank, alpha and targets must equal this section's."""

    def validate(self) -> None:
        self._at_least("rank", 0)
        if self.rank == 0:
            default = LoraConfig()
            for name in ("alpha", "dropout", "targets", "adapter_path"):
                if getattr(self, name) != getattr(default, name):
                    raise ValueError(f"{self._key(name)}={getattr(self, name)!r} is only used with LoRA on: set "
                                     f"{self._key('rank')} > 0")
            return
        self._positive("alpha")
        self._require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        targets = list(self.targets)
        if targets == ["all"]:
            self.targets = list(LORA_TARGETS)
            return
        bad = [t for t in targets if t not in LORA_TARGETS]
        self._require(bool(targets) and not bad and len(set(targets)) == len(targets), "targets",
                      f"must be a list of distinct names from {'|'.join(LORA_TARGETS)} (or [all])")


@dataclass
class ModelConfig(_Section):
    _section: ClassVar[str] = "model"

    hf_path: str = ""
    """HF checkpoint directory: config.json, *.safetensors and the tokenizer. Trainer and engines
    both start from it; the controller requires it to be set."""
    dtype: str = "float32"
    """Parameter/compute dtype of trainer and engines: float32|bfloat16|float16."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding/output vocabulary to a multiple of this (times TP size), in tokens."""
    use_transformer_engine: str = "auto"
    """Megatron layer spec: auto (Transformer Engine when importable and CUDA present, unless an
    enabled option runs on the local spec only: LoRA, trainer.shared_prefix, a named
    model.attention_backend; start-up then says so in one line) | true (refused with those options) | false."""
    attention_backend: str = "auto"
    """Core attention of the local (non-TE) layer spec: flash (torch's varlen flash attention for
    packed rows, SDPA for padded ones: CUDA, bfloat16/float16) | local (Megatron's DotProductAttention,
    per sample for packed rows: any device and dtype) | auto (flash on CUDA in bfloat16/float16, local
    otherwise). With Transformer Engine in use its own attention runs and only auto is accepted."""
    moe_aux_loss_coeff: Optional[float] = None
    """MoE models: coefficient of the load-balancing (aux) loss added to the policy loss; null = the
    checkpoint's router_aux_loss_coef. Rejected for a dense model."""
    moe_token_dispatcher: str = "auto"
    """MoE models: how tokens reach their experts across expert-parallel ranks: auto (alltoall with
    CUDA, allgather without) | allgather | alltoall (needs CUDA)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (LoRA) on a frozen base; off unless model.lora.rank > 0 (docs/lora.md)."""

    def __post_init__(self) -> None:
        # YAML `true`/`false` arrive as bools, which OmegaConf turns into 'True'/'False'.
        self.use_transformer_engine = str(self.use_transformer_engine).lower()

    def validate(self) -> None:
        self._one_of("dtype", DTYPES)
        self._at_least("make_vocab_size_divisible_by", 1)
        self._one_of("use_transformer_engine", TRI_STATE)
        self._one_of("attention_backend", ATTENTION_BACKENDS)
        if self.attention_backend == "flash" and self.dtype == "float32":
            raise ValueError("model.attention_backend=flash needs model.dtype=bfloat16 or float16 (flash attention "
                             "has no float32 kernel); use local for float32")
        self._one_of("moe_token_dispatcher", MOE_DISPATCHERS)
        if self.moe_aux_loss_coeff is not None:
            self._at_least("moe_aux_loss_coeff", 0.0)
        self.lora.validate()
        if self.lora.rank and self.use_transformer_engine == "true":
            raise ValueError("model.lora.rank > 0 needs the local layer spec (Transformer Engine's fused norm + "
                             "linear layers take no adapters here): set model.use_transformer_engine=false or auto")
        if self.attention_backend != "auto" and self.use_transformer_engine == "true":
            raise ValueError(f"model.attention_backend={self.attention_backend} is a core attention of the local layer "
                             "spec, but model.use_transformer_engine=true asks for Transformer Engine's: set "
                             "model.use_transformer_engine=auto or false, or model.attention_backend=auto")
