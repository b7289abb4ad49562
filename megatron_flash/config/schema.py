"""Typed run configuration: one dataclass per component, defaults live there and nowhere else.

Each section is a module of megatron_flash/config/sections/ (model, parallel, trainer, optimizer, loss,
rollout, async_rl, engines, weight_sync, agentic, data, eval, logging, checkpoint, distill: its
dataclass and the choices its fields take); this module assembles them into `RunConfig`, holds the
rules that span sections, and re-exports every section's names.

Every field carries a docstring (the string literal right under it) saying what it means and its
unit. ``validate()`` on a section checks that section alone; ``RunConfig.validate()`` checks every
section and then the rules that span sections. Errors are ``ValueError`` naming the full dotted key
and the offending value, e.g. ``parallel.tensor_model_parallel_size must be >= 1, got 0``.

Names of losses, rewards and synthetic tasks are plain strings here: their registries live in
packages that import torch, so they are checked when the component is built, not at load time.
This module imports nothing heavy, so a launcher can validate a config before touching torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict

from megatron_flash.config.sections.agentic import AgenticConfig, TOOL_PARSER_NAMES
from megatron_flash.config.sections.async_rl import AsyncConfig, STALE_POLICIES, ADMISSIONS
from megatron_flash.config.sections.base import _Section
from megatron_flash.config.sections.checkpoint import CheckpointConfig
from megatron_flash.config.sections.data import DataConfig
from megatron_flash.config.sections.distill import (
    DistillConfig, DISTILL_MODES, DEFAULT_DISTILL_TOPK, DISTILL_STUDENT_LOGPROBS,
)
from megatron_flash.config.sections.engines import EngineConfig, ENGINE_BACKENDS
from megatron_flash.config.sections.engines import _ENGINE_OWNED_FLAGS
from megatron_flash.config.sections.eval import EvalConfig
from megatron_flash.config.sections.logging import LoggingConfig, WANDB_MODES
from megatron_flash.config.sections.loss import (
    LossConfig, AGGREGATIONS, ADVANTAGES, PROX_LOGPROBS, KL_ESTIMATORS,
)
from megatron_flash.config.sections.model import (
    LoraConfig, ModelConfig, DTYPES, TRI_STATE, ATTENTION_BACKENDS, MOE_DISPATCHERS, LORA_TARGETS,
)
from megatron_flash.config.sections.optimizer import OptimizerConfig, OPTIMIZERS, LR_DECAY_STYLES
from megatron_flash.config.sections.parallel import ParallelConfig, DIST_BACKENDS
from megatron_flash.config.sections.rollout import (
    RolloutConfig, DYNAMIC_FILTERS, PAUSE_MODES, ROLLOUT_RUNNERS,
)
from megatron_flash.config.sections.trainer import (
    TrainerConfig, RECOMPUTE, RECOMPUTE_METHODS, ROUTING_REPLAY, ModeTraits, RUN_MODES,
)
from megatron_flash.config.sections.weight_sync import (
    WeightSyncConfig, WEIGHT_TRANSPORTS, LORA_SYNC_MODES,
)

__all__ = [  # every section's names, for `from megatron_flash.config.schema import ...`
    "ADMISSIONS", "ADVANTAGES", "AGGREGATIONS", "ATTENTION_BACKENDS", "AgenticConfig", "AsyncConfig",
    "CheckpointConfig", "DEFAULT_DISTILL_TOPK", "DISTILL_MODES", "DISTILL_STUDENT_LOGPROBS", "DIST_BACKENDS",
    "DTYPES", "DYNAMIC_FILTERS", "DataConfig", "DistillConfig", "ENGINE_BACKENDS", "EngineConfig", "EvalConfig",
    "KL_ESTIMATORS", "LORA_SYNC_MODES", "LORA_TARGETS", "LR_DECAY_STYLES", "LoggingConfig", "LoraConfig",
    "LossConfig", "MOE_DISPATCHERS", "ModeTraits", "ModelConfig", "OPTIMIZERS", "OptimizerConfig", "PAUSE_MODES",
    "PROX_LOGPROBS", "ParallelConfig", "RECOMPUTE", "RECOMPUTE_METHODS", "ROLLOUT_RUNNERS", "ROUTING_REPLAY",
    "RUN_MODES", "RolloutConfig", "RunConfig", "STALE_POLICIES", "TOOL_PARSER_NAMES", "TRI_STATE", "TrainerConfig",
    "WANDB_MODES", "WEIGHT_TRANSPORTS", "WeightSyncConfig", "_ENGINE_OWNED_FLAGS", "_Section",
]


@dataclass
class RunConfig:
    """The whole run. Components receive their own section, never the whole tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint and its numerics."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps and batch sizes."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss, aggregation and advantages."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and rollout scheduling."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Rollout–train asynchrony (YAML key `async_rl`: `async` is a Python keyword)."""
    engines: EngineConfig = field(default_factory=EngineConfig)
    """Inference engines."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer → engine weight updates."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source."""
    agentic: AgenticConfig = field(default_factory=AgenticConfig)
    """Multi-turn environments (empty env = single-turn RLVR)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and run directory."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and final export."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation on held-out sets (mean@k, pass@k), pinned to one weight version."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (off unless distill.teacher is set)."""

    def sections(self) -> Dict[str, _Section]:
        """Section name → section object, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def probe_threshold(self) -> float:
        """weight_sync.probe_threshold with null resolved: 0.05, or 0.3 for 16-bit engines under an fp32 trainer."""
        if self.weight_sync.probe_threshold is not None:
            return self.weight_sync.probe_threshold
        low = self.engines.dtype in ("bfloat16", "float16") and self.model.dtype == "float32"
        return 0.3 if low else 0.05

    def delta_sync(self) -> str:
        """What the bridge does with weight_sync.delta: on (every engine must take deltas), auto (the
        engines that take them; whole pushes to the others) or off. auto is off over ipc (same node),
        with colocated engines and with adapter pushes."""
        ws = self.weight_sync
        if ws.delta == "off" or self.engines.colocate or self.lora_sync_mode() == "adapter":
            return "off"
        if ws.delta == "auto" and ws.transport == "ipc":
            return "off"
        return ws.delta

    def lora_sync_mode(self) -> str:
        """What a push sends with model.lora on: weight_sync.lora with auto resolved ("" without LoRA)."""
        if not self.model.lora.rank:
            return ""
        if self.weight_sync.lora != "auto":
            return self.weight_sync.lora
        local = self.engines.backend == "local" and self.weight_sync.transport != "broadcast" and not self.engines.colocate
        return "adapter" if local else "merged"

    def off_policy_reason(self) -> str:
        """Why the policy trains on samples another policy drew ("" when it trains on-policy, or not at
        all): a loss without behaviour correction is refused then (see loss.allow_uncorrected)."""
        mode = RUN_MODES.get(self.trainer.mode)
        if mode is None or not mode.trains:
            return ""
        alpha = self.async_rl.alpha
        if alpha > 0 and not mode.replays:
            return f"async_rl.alpha={alpha} trains samples up to {alpha} policy versions old"
        if mode.replays:
            return "trainer.mode=train_only trains samples replayed from another run's policy"
        return ""

    def validate(self) -> None:
        """Validate every section, then the rules that span sections; ValueError names the key."""
        for section in self.sections().values():
            section.validate()
        trainer, rollout = self.trainer, self.rollout
        n = rollout.n_samples_per_prompt
        if trainer.global_batch_size % n:
            raise ValueError(
                f"trainer.global_batch_size must be divisible by rollout.n_samples_per_prompt={n} "
                f"(an optimizer step holds whole prompt groups), got {trainer.global_batch_size}"
            )
        if self.agentic.env and self.agentic.max_episode_tokens >= trainer.max_seq_len:
            raise ValueError(
                f"agentic.max_episode_tokens must be < trainer.max_seq_len={trainer.max_seq_len} "
                f"(the first observation needs room), got {self.agentic.max_episode_tokens}"
            )
        if not self.agentic.env and rollout.max_new_tokens >= trainer.max_seq_len:
            raise ValueError(
                f"rollout.max_new_tokens must be < trainer.max_seq_len={trainer.max_seq_len} "
                f"(the prompt needs room), got {rollout.max_new_tokens}"
            )
        if trainer.moe_routing_replay != "off" and (self.agentic.env or self.agentic.workflow):
            raise ValueError(
                "trainer.moe_routing_replay=rollout is not built for agentic episodes (agentic.env or workflow is set): "
                "a multi-turn sample's observation tokens were never routed by the engine"
            )
        if (rollout.overlong_buffer_len or rollout.overlong_filter) and (self.agentic.env or self.agentic.workflow):
            raise ValueError("rollout.overlong_buffer_len / rollout.overlong_filter are not built for agentic "
                             "episodes (agentic.env or workflow is set): an episode's length is not one response's")
        if self.distill.enabled and (self.agentic.env or self.agentic.workflow):
            raise ValueError("distill.teacher is not built for agentic episodes (agentic.env or workflow is set): "
                             "the teacher scores single-turn responses")
        if self.distill.enabled and self.engines.backend == "attach" and not self.distill.urls:
            raise ValueError("distill.urls must list the teacher engines when engines.backend=attach (a run that "
                             "attaches its student engines launches none, the teacher's included)")
        cp = self.parallel.context_parallel_size
        if cp > 1 and trainer.shared_prefix:
            raise ValueError(f"parallel.context_parallel_size={cp} with trainer.shared_prefix=true is not built (a shared "
                             "prompt's keys would have to be gathered across ranks per response); use one of them")
        if cp > 1 and not trainer.pack_sequences:
            raise ValueError(f"parallel.context_parallel_size={cp} needs trainer.pack_sequences=true (each packed "
                             "sequence is split into 2·CP chunks)")
        if cp > 1 and self.model.use_transformer_engine == "true":
            raise ValueError(f"parallel.context_parallel_size={cp} runs on the local layer spec (its attention "
                             "all-gathers K/V itself): set model.use_transformer_engine=auto or false")
        if trainer.shared_prefix and self.model.use_transformer_engine == "true":
            raise ValueError("trainer.shared_prefix=true needs the local layer spec (Transformer Engine's packed "
                             "attention has no prompt-to-response mask): set model.use_transformer_engine=auto or false")
        if trainer.shared_prefix and self.agentic.workflow:
            raise ValueError("trainer.shared_prefix is refused for agent workflows (agentic.workflow is set): a "
                             "gateway trajectory's first turn is the agent's own tokenisation, so the samples of a "
                             "group need not start with the same prompt ids")
        if rollout.runner == "process" and (self.agentic.env or self.agentic.workflow):
            raise ValueError("rollout.runner=process is not built for agentic episodes (agentic.env or workflow "
                             "is set): their environments and gateway live in the trainer process; use thread")
        if self.eval.datasets and (trainer.mode != "full" or self.agentic.env or self.agentic.workflow):
            raise ValueError("eval.datasets: evaluation runs in trainer.mode=full single-turn runs "
                             "(launch/evaluate.py evaluates any checkpoint on its own)")
        if self.checkpoint.save_hf_interval and not RUN_MODES[trainer.mode].trains:
            raise ValueError(f"checkpoint.save_hf_interval={self.checkpoint.save_hf_interval}: "
                             f"trainer.mode={trainer.mode} trains nothing to export")
        if self.loss.allow_uncorrected and not self.off_policy_reason():
            raise ValueError(
                f"loss.allow_uncorrected=true is only used when training samples can be off-policy "
                f"(async_rl.alpha > 0, or trainer.mode=train_only); got async_rl.alpha={self.async_rl.alpha}, "
                f"trainer.mode={trainer.mode}"
            )
        if self.distill.enabled and self.distill.topk == 0 and self.async_rl.alpha > 0 \
                and not self.distill.allow_sampled_estimate:
            raise ValueError(
                f"distill.topk=0 (the sampled-token estimate alone) is refused at async_rl.alpha="
                f"{self.async_rl.alpha}: on stale samples it drove the student's reward to 0 and the reverse "
                f"KL up (docs/benchmarks.md); use distill.topk={DEFAULT_DISTILL_TOPK} (the default), async_rl.alpha=0, "
                f"or distill.allow_sampled_estimate=true to measure it")
        if self.distill.allow_sampled_estimate and not (self.distill.enabled and self.distill.topk == 0
                                                        and self.async_rl.alpha > 0):
            raise ValueError("distill.allow_sampled_estimate=true is only used with distill.teacher set, "
                             f"distill.topk=0 and async_rl.alpha > 0; got distill.topk={self.distill.topk}, "
                             f"async_rl.alpha={self.async_rl.alpha}")
        if self.weight_sync.lora != "auto" and not self.model.lora.rank:
            raise ValueError(f"weight_sync.lora={self.weight_sync.lora} is only used with LoRA on (model.lora.rank > 0)")
        if self.weight_sync.lora == "adapter" and self.engines.colocate:
            raise ValueError("weight_sync.lora=adapter with engines.colocate=true: colocated engines give their "
                             "weights' memory back while the trainer steps, so every push must carry the whole "
                             "model; use weight_sync.lora=merged")
        if self.weight_sync.lora == "adapter" and self.weight_sync.transport == "broadcast":
            raise ValueError("weight_sync.lora=adapter with weight_sync.transport=broadcast: engines take adapters "
                             "through their LoRA API (tensors in shared memory, or a PEFT folder on disk), not over "
                             "a process group; use weight_sync.transport=ipc or disk, or weight_sync.lora=merged")
        if self.delta_sync() == "off":  # the delta knobs would do nothing: refused, not ignored
            for key, default in (("delta_anchor_every", 20), ("delta_max_density", 0.5)):
                if getattr(self.weight_sync, key) != default:
                    raise ValueError(f"weight_sync.{key} is only used with delta pushes, which are off here "
                                     f"(weight_sync.delta={self.weight_sync.delta}, transport="
                                     f"{self.weight_sync.transport}); set weight_sync.delta=on or remove it")
        if self.weight_sync.delta == "on" and self.engines.colocate:
            raise ValueError("weight_sync.delta=on with engines.colocate=true: colocated engines release their "
                             "weights' memory while the trainer steps and lose the values a delta applies to; "
                             "use weight_sync.delta=off")
        if self.weight_sync.delta == "on" and self.lora_sync_mode() == "adapter":
            raise ValueError("weight_sync.delta=on with weight_sync.lora=adapter: adapter pushes carry only the "
                             "adapters (already small) through the engines' LoRA API; use weight_sync.lora=merged "
                             "for deltas of the merged weights, or weight_sync.delta=off")
        if self.weight_sync.delta == "on" and self.engines.backend == "sglang":
            raise ValueError("weight_sync.delta=on with engines.backend=sglang: SGLang does not apply deltas yet "
                             "(weight_sync.delta=auto sends them whole)")
        if self.engines.join_port and self.weight_sync.transport == "ipc":
            raise ValueError("engines.join_port with weight_sync.transport=ipc: engines that join come from other "
                             "hosts, which CUDA IPC / shared memory cannot reach; use weight_sync.transport=broadcast "
                             "or disk (a filesystem every engine host sees)")
        if self.engines.join_port and self.rollout.runner != "thread":
            raise ValueError("engines.join_port needs rollout.runner=thread (the fleet changes on the trainer's rollout "
                             "loop; the process runner does not take joins yet)")
        if self.engines.colocate and self.async_rl.alpha != 0:
            raise ValueError(
                f"async_rl.alpha must be 0 with engines.colocate=true (colocated engines sleep while the "
                f"trainer holds the GPUs, so rollout cannot run ahead), got {self.async_rl.alpha}"
            )
        if n < 2 and self.loss.advantage in ("grpo", "rloo"):
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 2 with loss.advantage={self.loss.advantage} "
                f"(a group of one has no baseline; use loss.advantage=reinforce), got {n}"
            )
        if n < 2 and rollout.dynamic_filter == "nonzero_std":
            raise ValueError(
                "rollout.n_samples_per_prompt must be >= 2 with rollout.dynamic_filter=nonzero_std "
                f"(a group of one always has zero std), got {n}"
            )
