"""The trainer's parallel layout (`parallel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_flash.config.sections.base import _Section

DIST_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig(_Section):
    _section: ClassVar[str] = "parallel"

    tensor_model_parallel_size: int = 1
    """Trainer tensor-parallel degree (ranks sharing each layer)."""
    pipeline_model_parallel_size: int = 1
    """Trainer pipeline-parallel degree (stages). Data parallel = world size / (TP × PP)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the TP group (activations outside attention/MLP are split
    along the sequence); needs TP > 1. Works on NCCL and on gloo (CPU)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when CUDA is available, else gloo)|gloo|nccl."""
    collective_timeout_s: float = 600.0
    """Deadline of every collective and barrier of the trainer's process groups (torch.distributed's
    timeout): a rank that never arrives (hung or dead peer) fails the others after this long instead
    of wedging the job."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved 1F1B: model chunks per pipeline stage (each stage holds V non-contiguous blocks
    of layers); null = no interleaving. num_hidden_layers must divide by PP × V."""
    context_parallel_size: int = 1
    """Context parallelism: each sequence split into 2·CP chunks over this many ranks (rank r holds
    chunks r and 2·CP−1−r), K/V all-gathered in attention, on the local layer spec (CPU, any dtype;
    flash attention on CUDA): docs/trainer.md. Needs packed micro-batches; refused with
    trainer.shared_prefix and with mixture-of-experts models. World = TP × PP × CP × DP."""
    expert_model_parallel_size: int = 1
    """MoE models: the experts of every MoE layer are split over this many ranks (EP). The number of
    experts must divide by it, and the world size by expert_tensor_parallel_size × EP × PP."""
    expert_tensor_parallel_size: Optional[int] = None
    """MoE models: each expert's weights are split over this many ranks (ETP); null = the
    tensor-parallel size (Megatron's default). The expert FFN size must divide by it."""

    def validate(self) -> None:
        self._at_least("tensor_model_parallel_size", 1)
        self._at_least("pipeline_model_parallel_size", 1)
        self._at_least("context_parallel_size", 1)
        self._at_least("expert_model_parallel_size", 1)
        if self.expert_tensor_parallel_size is not None:
            self._at_least("expert_tensor_parallel_size", 1)
        self._one_of("backend", DIST_BACKENDS)
        self._positive("collective_timeout_s")
        if self.sequence_parallel:
            self._require(self.tensor_model_parallel_size > 1, "sequence_parallel",
                          "needs parallel.tensor_model_parallel_size > 1")
        if self.virtual_pipeline_model_parallel_size is not None:
            self._at_least("virtual_pipeline_model_parallel_size", 1)
            self._require(self.pipeline_model_parallel_size > 1, "virtual_pipeline_model_parallel_size",
                          "needs parallel.pipeline_model_parallel_size > 1")
