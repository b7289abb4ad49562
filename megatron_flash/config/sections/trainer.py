"""Steps, batch sizes and run modes (`trainer`); `RUN_MODES` says what each mode does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional

from megatron_flash.config.sections.base import _Section

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
ROUTING_REPLAY = ("off", "rollout")


@dataclass(frozen=True)
class ModeTraits:
    """What a run mode (`trainer.mode`) does; every mode-specific choice of the controller reads one
    of these, so a mode is defined here and nowhere else."""

    trains: bool
    """A Megatron policy is built and trained."""
    generates: bool
    """Engines are started and the rollout side runs."""
    syncs_weights: bool
    """Trained weights are pushed to the engines (needs both of the above)."""
    replays: bool
    """Batches come from trainer.replay_path instead of the rollout buffer."""
    dumps_groups: bool
    """Every finished group is written to rollout.dump_path (or {logging.dir}/groups.jsonl)."""
    checkpoints: bool
    """checkpoint.save_interval saves the policy with the rollout state (a replay has no rollout
    state to resume, a rollout-only run no policy)."""


RUN_MODES: Dict[str, ModeTraits] = {
    "full": ModeTraits(trains=True, generates=True, syncs_weights=True, replays=False, dumps_groups=False,
                       checkpoints=True),
    "rollout_only": ModeTraits(trains=False, generates=True, syncs_weights=False, replays=False, dumps_groups=True,
                               checkpoints=False),
    "train_only": ModeTraits(trains=True, generates=False, syncs_weights=False, replays=True, dumps_groups=False,
                             checkpoints=False),
}


@dataclass
class TrainerConfig(_Section):
    _section: ClassVar[str] = "trainer"

    total_steps: int = 100
    """Optimizer steps to run (each one bumps the policy version by 1)."""
    micro_batch_size: int = 4
    """Samples (sequences) per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = 64
    """Samples per optimizer step across all DP ranks = prompts per step × n_samples_per_prompt."""
    num_epochs: int = 1
    """Passes over each rollout batch."""
    num_mini_batches: int = 1
    """Optimizer steps per pass over a rollout batch (a rollout batch is num_mini_batches ×
    global_batch_size samples)."""
    seed: int = 1234
    """Seed for model init, data order and sampling."""
    max_seq_len: int = 512
    """Longest prompt + response the trainer accepts, in tokens."""
    mode: str = "full"
    """full (rollout + training, asynchronously) | rollout_only (generate, reward and dump groups to
    rollout.dump_path; no training) | train_only (train on groups replayed from trainer.replay_path;
    no engines)."""
    replay_path: str = ""
    """Groups dumped by a rollout_only run (jsonl), replayed when trainer.mode=train_only."""
    pack_sequences: bool = True
    """Pack each micro-batch's samples end to end into one row (positions restart per sample,
    attention never crosses a sample), instead of padding every sample to the step's longest."""
    max_tokens_per_micro_batch: int = 0
    """With pack_sequences: close a micro-batch before it exceeds this many tokens (samples stay
    whole; the micro-batch count then varies per step and DP ranks are balanced by tokens). 0 = no
    token limit. A micro-batch also never holds more than micro_batch_size samples."""
    shared_prefix: bool = False
    """With pack_sequences: the samples of a group (one prompt, n responses) become one packed segment,
    the prompt once and each response after it, attending to the prompt as in its own row: the
    trainer computes every prompt once instead of n times, with the same loss and gradients
    (trainer/shared_prefix.py). Every forward over training batches uses it (training, π_prox, the
    reference, distillation). Refused for MoE models, Transformer Engine's attention and agent
    workflows (their samples' prompt tokens need not match)."""
    recompute: str = "none"
    """Activation recomputation: none | selective (core attention, Megatron's default modules) |
    full (whole layers, by recompute_method / recompute_num_layers)."""
    recompute_method: Optional[str] = None
    """With recompute=full only: uniform (every chunk of recompute_num_layers layers; the default) |
    block (the first recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """With recompute=full only: layers per recomputed chunk (uniform) or per stage (block); default 1."""
    moe_routing_replay: str = "off"
    """MoE only: off (the trainer's routers choose their own experts) | rollout (R3: the engines return
    the experts they routed every token to, and every trainer forward of that sample — training,
    π_prox, reference — routes the token to the same experts; SGLang engines get
    --enable-return-routed-experts)."""
    max_nonfinite_steps: int = 3
    """A step whose gradient has a NaN/inf anywhere is skipped (no update, counted as
    train/nonfinite_skipped); this many in a row stop the run, the last batch's samples dumped."""
    version_check_interval: int = 4
    """Every this many policy versions the trainer keeps a host copy of its weights until no sample
    can hold tokens of that version (alpha steps) and scores the trained tokens labelled with it under
    those weights: mismatch_labelled_abs, the train–inference gap at the labelled version (≈1e-6 in
    fp32; a wrong version label shows as the policy's movement). 1 = every version (α + 1 copies: the
    diagnostic mode), 0 = off. Costs a copy of this rank's weights in host memory and one forward of
    the checked samples per step that has any (trainer/version_check.py)."""

    def validate(self) -> None:
        for name in ("total_steps", "micro_batch_size", "global_batch_size", "num_epochs",
                     "num_mini_batches"):
            self._at_least(name, 1)
        self._at_least("seed", 0)
        self._at_least("max_seq_len", 2)
        self._at_least("max_nonfinite_steps", 1)
        self._at_least("version_check_interval", 0)
        if not self.pack_sequences:  # fixed micro-batches of micro_batch_size samples
            self._require(self.global_batch_size % self.micro_batch_size == 0, "global_batch_size",
                          f"must be divisible by trainer.micro_batch_size={self.micro_batch_size}")
        self._at_least("max_tokens_per_micro_batch", 0)
        if self.max_tokens_per_micro_batch:
            self._require(self.pack_sequences, "max_tokens_per_micro_batch",
                          "needs trainer.pack_sequences=true (padded micro-batches have a fixed size)")
        if self.shared_prefix:
            self._require(self.pack_sequences, "shared_prefix", "needs trainer.pack_sequences=true (a shared "
                          "prompt is a packed segment)")
        self._one_of("recompute", RECOMPUTE)
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(self, name) is not None:
                self._require(self.recompute == "full", name, "is only used with trainer.recompute=full")
        if self.recompute_method is not None:
            self._one_of("recompute_method", RECOMPUTE_METHODS)
        if self.recompute_num_layers is not None:
            self._at_least("recompute_num_layers", 1)
        self._one_of("mode", RUN_MODES)
        self._one_of("moe_routing_replay", ROUTING_REPLAY)
        if self.mode == "train_only":
            self._require(bool(self.replay_path), "replay_path", "must be set when trainer.mode=train_only")
