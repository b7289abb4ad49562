"""What the Megatron policy needs from the run config (`PolicySettings`), gathered from the four
sections it reads: model, parallel, trainer, optimizer (never the whole tree)."""

from __future__ import annotations

import dataclasses

from megatron_flash.config.schema import ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from megatron_flash.trainer.lora import LoraOptions
from megatron_flash.trainer.model_builder import MoEOptions, ScaleOptions, local_spec_reasons


@dataclasses.dataclass
class PolicySettings:
    """What the policy needs from the run config; the optimizer section is the config's own."""

    hf_path: str
    tp_size: int = 1
    pp_size: int = 1
    dtype: str = "float32"
    micro_batch_size: int = 4
    pack_sequences: bool = True
    shared_prefix: bool = False
    max_tokens_per_micro_batch: int = 0
    max_seq_len: int = 0  # 0 = no check
    scale: ScaleOptions = dataclasses.field(default_factory=ScaleOptions)
    moe: MoEOptions = dataclasses.field(default_factory=MoEOptions)
    lora: LoraOptions = dataclasses.field(default_factory=LoraOptions)
    seed: int = 1234
    optimizer_steps: int = 100  # of the whole run: the LR schedule's length
    make_vocab_size_divisible_by: int = 128
    use_transformer_engine: str = "auto"
    attention_backend: str = "auto"  # local spec: flash | local | auto (trainer/flash_attention.py)
    backend: str = "auto"
    collective_timeout_s: float = 600.0
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        self.optimizer.validate()
        if self.max_tokens_per_micro_batch and not self.pack_sequences:
            raise ValueError("trainer.max_tokens_per_micro_batch needs trainer.pack_sequences=true")
        if self.shared_prefix and not self.pack_sequences:
            raise ValueError("trainer.shared_prefix needs trainer.pack_sequences=true (shared prompts are packed segments)")

    def local_spec_reasons(self) -> list[str]:
        """The enabled options that need the local (TE-free) layer spec, by key (resolve_te)."""
        return local_spec_reasons(lora_rank=self.lora.rank, shared_prefix=self.shared_prefix,
                                  attention_backend=self.attention_backend,
                                  context_parallel_size=self.scale.context_parallel_size)

    @classmethod
    def from_sections(cls, *, model: "ModelConfig", parallel: "ParallelConfig", trainer: "TrainerConfig",
                      optimizer: OptimizerConfig) -> "PolicySettings":
        """From the four config sections the policy reads (never the whole tree)."""
        t, p = trainer, parallel
        return cls(
            hf_path=model.hf_path, tp_size=p.tensor_model_parallel_size,
            pp_size=p.pipeline_model_parallel_size, dtype=model.dtype,
            micro_batch_size=t.micro_batch_size, pack_sequences=t.pack_sequences, shared_prefix=t.shared_prefix,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, max_seq_len=t.max_seq_len,
            scale=ScaleOptions(sequence_parallel=p.sequence_parallel,
                               virtual_pipeline_size=p.virtual_pipeline_model_parallel_size,
                               context_parallel_size=p.context_parallel_size, recompute=t.recompute,
                               recompute_method=t.recompute_method or "uniform",
                               recompute_num_layers=t.recompute_num_layers or 1),
            moe=MoEOptions(ep_size=p.expert_model_parallel_size, etp_size=p.expert_tensor_parallel_size,
                           aux_loss_coeff=model.moe_aux_loss_coeff, token_dispatcher=model.moe_token_dispatcher,
                           routing_replay=t.moe_routing_replay == "rollout"),
            lora=LoraOptions.from_config(model.lora, seed=t.seed), seed=t.seed, optimizer_steps=t.total_steps * t.num_epochs * t.num_mini_batches,
            make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
            use_transformer_engine=model.use_transformer_engine, attention_backend=model.attention_backend,
            backend=p.backend,
            collective_timeout_s=p.collective_timeout_s, optimizer=optimizer,
        )
