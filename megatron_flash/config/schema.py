"""Typed run configuration: one dataclass per component, defaults live here and nowhere else.

Every field carries a docstring (the string literal right under it) saying what it means and its
unit. ``validate()`` on a section checks that section alone; ``RunConfig.validate()`` checks every
section and then the rules that span sections. Errors are ``ValueError`` naming the full dotted key
and the offending value, e.g. ``parallel.tensor_model_parallel_size must be >= 1, got 0``.

Names of losses, rewards and synthetic tasks are plain strings here: their registries live in
packages that import torch, so they are checked when the component is built, not at load time.
This module imports nothing heavy, so a launcher can validate a config before touching torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Sequence

from megatron_flash.config.task_args import TASKS_WITH_ARGS, check_task

DTYPES = ("float32", "bfloat16", "float16")
TRI_STATE = ("auto", "true", "false")
ATTENTION_BACKENDS = ("auto", "flash", "local")
DIST_BACKENDS = ("auto", "gloo", "nccl")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
ADVANTAGES = ("grpo", "rloo", "reinforce")
PROX_LOGPROBS = ("recompute", "approximate")
DISTILL_MODES = ("add", "only")
DEFAULT_DISTILL_TOPK = 4
"""distill.topk's default: the teacher's K most likely tokens per position (docs/benchmarks.md, the K sweep)."""
DISTILL_STUDENT_LOGPROBS = ("current", "behavior")
KL_ESTIMATORS = ("k1", "k3")
DYNAMIC_FILTERS = ("none", "nonzero_std")  # built-ins; "module:function" names a user filter
PAUSE_MODES = ("abort", "retract", "in_place")
ROLLOUT_RUNNERS = ("thread", "process")
STALE_POLICIES = ("drop", "regenerate")
ADMISSIONS = ("tokens", "adaptive", "eager")  # = buffer/staleness.py ADMISSIONS (a unit test keeps them equal)
ENGINE_BACKENDS = ("local", "sglang", "attach")
WEIGHT_TRANSPORTS = ("ipc", "broadcast", "disk")
WANDB_MODES = ("offline", "online", "disabled")
RECOMPUTE = ("none", "selective", "full")
ROUTING_REPLAY = ("off", "rollout")
TOOL_PARSER_NAMES = ("hermes",)  # = agentic/gateway/tool_parsers.py TOOL_PARSERS (a unit test keeps them equal)
RECOMPUTE_METHODS = ("uniform", "block")
MOE_DISPATCHERS = ("auto", "allgather", "alltoall")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # = trainer/lora.py TARGETS (a unit test keeps them equal)
LORA_SYNC_MODES = ("auto", "merged", "adapter")



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

# SGLang flags that megatron-flash sets itself from `engines.*`; repeating them in
# `engines.server_args` would give two sources of truth for one value.
_ENGINE_OWNED_FLAGS = {
    "model-path": "model.hf_path",
    "model": "model.hf_path",
    "host": "engines.host",
    "port": "engines.base_port",
    "tp-size": "engines.tp_size",
    "tensor-parallel-size": "engines.tp_size",
    "base-gpu-id": "engines.gpu_ids",
    "api-key": "engines.api_key",
}


class _Section:
    """Checks shared by the section dataclasses; ``_section`` is the section's key in RunConfig."""

    _section: ClassVar[str] = ""

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}"

    def _require(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ValueError(f"{self._key(name)} {requirement}, got {getattr(self, name)!r}")

    def _at_least(self, name: str, minimum: float) -> None:
        self._require(getattr(self, name) >= minimum, name, f"must be >= {minimum}")

    def _positive(self, name: str) -> None:
        self._require(getattr(self, name) > 0, name, "must be > 0")

    def _one_of(self, name: str, choices: Sequence[str]) -> None:
        self._require(getattr(self, name) in choices, name, f"must be one of {'|'.join(choices)}")

    def validate(self) -> None:
        raise NotImplementedError


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
    """Context parallelism: each sequence split over this many ranks. Megatron-Core implements it in
    Transformer Engine attention only, so > 1 needs TE (and CUDA); world = TP × PP × CP × DP."""
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


@dataclass
class OptimizerConfig(_Section):
    _section: ClassVar[str] = "optimizer"

    name: str = "adam"
    """adam (AdamW-style decoupled weight decay, as Megatron) | sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of linear/cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Max global gradient L2 norm; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_style: str = "constant"
    """LR schedule after warm-up: constant|linear|cosine (decay to min_lr at trainer.total_steps)."""
    skip_zero_grad: bool = True
    """Skip the optimizer step (Adam's moments, its step count and weight decay untouched) when the whole
    gradient is exactly zero: every advantage and loss term of the batch was zero, e.g. all replies of
    every group scored alike. The LR schedule and the policy version still advance. Counted as
    train/zero_grad_skipped. false = step anyway (moments decay toward zero on a saturated task, and
    the next real gradient then takes an outsized step; trainer/weight_health.py)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and master weights over the data-parallel group (Megatron ZeRO-1)."""
    cpu_offload_fraction: float = 0.0
    """Fraction of the optimizer state (and its update) kept in CPU memory, 0 = none (Megatron's
    optimizer_cpu_offload). Needs CUDA (on a CPU trainer everything already is in CPU memory) and
    use_distributed_optimizer."""

    def validate(self) -> None:
        self._one_of("name", OPTIMIZERS)
        self._positive("lr")
        self._at_least("min_lr", 0.0)
        self._require(self.min_lr <= self.lr, "min_lr", f"must be <= optimizer.lr={self.lr}")
        self._at_least("weight_decay", 0.0)
        for name in ("adam_beta1", "adam_beta2"):
            self._require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        self._positive("adam_eps")
        self._at_least("clip_grad", 0.0)
        self._at_least("lr_warmup_steps", 0)
        self._one_of("lr_decay_style", LR_DECAY_STYLES)
        self._require(0.0 <= self.cpu_offload_fraction <= 1.0, "cpu_offload_fraction", "must be in [0, 1]")
        if self.cpu_offload_fraction > 0:
            self._require(self.use_distributed_optimizer, "cpu_offload_fraction",
                          "needs optimizer.use_distributed_optimizer=true")


@dataclass
class LossConfig(_Section):
    _section: ClassVar[str] = "loss"

    name: str = "decoupled_ppo"
    """Registered loss name: decoupled_ppo, tis, cispo, topr, gspo (corrected for the engines' behaviour
    policy μ) | ppo, reinforce (no correction: refused on stale samples, see allow_uncorrected) | your own."""
    params: Dict[str, Any] = field(default_factory=dict)
    """Keyword parameters passed verbatim to the loss factory, e.g. {eps_high: 0.28}."""
    aggregation: str = "token_mean"
    """How per-token losses reduce: token_mean (over all tokens of the global batch) |
    seq_mean_token_mean (mean over tokens of each sequence, then over sequences; GSPO's) |
    seq_mean_token_sum (sum over tokens, mean over sequences) | seq_mean_token_sum_norm (token sum
    divided by a constant, then mean over sequences: Dr. GRPO)."""
    aggregation_norm: int = 0
    """The constant of seq_mean_token_sum_norm; 0 = rollout.max_new_tokens (the longest response)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (reward − group mean) | rloo (leave-one-out baseline) | reinforce."""
    advantage_std_normalize: bool = True
    """Divide group-centred advantages by the group's reward std (GRPO normalisation)."""
    kl_coef: float = 0.0
    """Weight of the KL(π_θ‖π_ref) penalty per token; 0 disables it and the reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1 (log-ratio) | k3 (exp(Δ) − Δ − 1, unbiased and non-negative)."""
    allow_uncorrected: bool = False
    """Train a loss registered without behaviour correction (ppo, reinforce, gspo with behavior_weight=none:
    a ratio against π_prox or none, never against the engines' μ) on off-policy samples (async_rl.alpha > 0,
    or trainer.mode=train_only), which is refused otherwise. It only lifts that refusal, so it is rejected
    where there is none to lift (a corrected loss, or on-policy training)."""
    prox_logprobs: str = "recompute"
    """Where π_prox (the weights a step starts from) comes from, for losses that read it:
    recompute (a forward pass over the batch before training) | approximate (no extra pass: the
    training forward's own logprobs on the step's first optimizer step, where they are exact; on later
    ones a log-linear interpolation between the behaviour logprobs and π_θ by version gap; docs/losses.md).
    approximate with a loss that does not read π_prox is refused."""

    def validate(self) -> None:
        self._require(bool(self.name), "name", "must be a non-empty loss name")
        self._one_of("aggregation", AGGREGATIONS)
        self._at_least("aggregation_norm", 0)
        if self.aggregation_norm and self.aggregation != "seq_mean_token_sum_norm":
            raise ValueError(f"loss.aggregation_norm={self.aggregation_norm} is only used with "
                             f"loss.aggregation=seq_mean_token_sum_norm (got {self.aggregation!r})")
        self._one_of("advantage", ADVANTAGES)
        self._at_least("kl_coef", 0.0)
        self._one_of("kl_estimator", KL_ESTIMATORS)
        self._one_of("prox_logprobs", PROX_LOGPROBS)
        for owned in ("kl_coef", "kl_estimator"):
            if owned in self.params:
                raise ValueError(f"loss.params.{owned} duplicates loss.{owned}; set loss.{owned} instead")


@dataclass
class RolloutConfig(_Section):
    _section: ClassVar[str] = "rollout"

    n_samples_per_prompt: int = 8
    """Responses per prompt (the group size for group-relative advantages)."""
    temperature: float = 1.0
    """Sampling temperature; keep 1.0 for logprobs of the raw policy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 256
    """Longest response, in tokens."""
    prompt_replication: bool = True
    """Send each of a prompt's n responses as its own request (spread over engines) instead of one
    request with n samples."""
    replication_chunk: int = 1
    """With prompt_replication: samples per request (SGLang `n`), so a group becomes
    ceil(n / replication_chunk) requests spread over engines. 1 = one request per sample; e.g.
    n / number of engines spreads a group as well with fewer requests and shared prefill."""
    extra_prompts: int = 0
    """Redundant prompts kept in flight beyond what the batch needs (surplus carried over)."""
    dynamic_filter: str = "none"
    """Group filter: none | nonzero_std (drop groups whose rewards are all equal) | "module:function"
    (your `fn(rewards) -> keep`, imported at start)."""
    pause_mode: str = "retract"
    """How engines pause for a weight update: abort (drop in-flight requests) | retract (requeue
    them, recompute KV after) | in_place (keep KV; tokens span two policy versions)."""
    reward: str = "exact_match"
    """Registered reward function name (exact_match, math, yours), or "module:function"."""
    reward_workers: int = 0
    """Processes scoring rewards off the rollout loop (CPU-heavy rewards such as math); 0 = inline."""
    reward_timeout_s: float = 30.0
    """Deadline of one reward call: past it the sample fails (its group is dropped and counted as
    reward_failed). With reward_workers > 0 the worker is killed and replaced; inline (0) the call runs
    on a thread of its own, which is abandoned (Python cannot stop a thread; a hung one keeps its CPU)
    and replaced, so a reward that may hang belongs in workers."""
    runner: str = "thread"
    """Where the rollout loop (scheduler, engine proxy, rewards, buffer admission) runs on trainer rank 0:
    thread (beside training, sharing its GIL) | process (a spawned process of its own; finished groups
    come to the trainer over a pipe). Single-turn runs only; a reward registered in a script's
    __main__ is not found there (use "module:function")."""
    max_prompt_retries: int = 3
    """A prompt whose group failed on the engines (transient errors: 5xx, timeouts, malformed replies,
    after the proxy's own retries on other engines) is re-queued at most this many times, then skipped
    and counted (skipped_prompts, skipped_after_retries); refusals (HTTP 4xx) are never retried."""
    dump_path: str = ""
    """Append every finished group as one JSON line here (always in trainer.mode=rollout_only)."""
    max_resumes: int = 16
    """Times one response may be aborted by weight pushes (pause_mode=abort) and resumed from its
    prefix before the run stops with an error."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong penalty: a response longer than max_new_tokens − this loses
    overlong_penalty × (its excess / this) of reward (all of it at max_new_tokens); 0 = off."""
    overlong_penalty: float = 1.0
    """The largest overlong penalty (subtracted from the reward of a response of max_new_tokens)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: truncated responses (finish_reason length) are kept out of the loss
    (their rewards still count in their group's advantages)."""

    def validate(self) -> None:
        self._at_least("n_samples_per_prompt", 1)
        self._positive("temperature")
        self._require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        self._require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1")
        self._at_least("max_new_tokens", 1)
        self._at_least("extra_prompts", 0)
        self._at_least("replication_chunk", 1)
        self._require(self.replication_chunk <= self.n_samples_per_prompt, "replication_chunk",
                      f"must be <= n_samples_per_prompt ({self.n_samples_per_prompt})")
        if ":" not in self.dynamic_filter:  # "module:function" names a user filter, imported at start
            self._one_of("dynamic_filter", DYNAMIC_FILTERS)
        self._one_of("pause_mode", PAUSE_MODES)
        self._require(bool(self.reward), "reward", "must be a non-empty reward name")
        self._at_least("reward_workers", 0)
        self._positive("reward_timeout_s")
        self._one_of("runner", ROLLOUT_RUNNERS)
        self._at_least("max_prompt_retries", 0)
        self._at_least("max_resumes", 0)
        self._at_least("overlong_buffer_len", 0)
        self._require(self.overlong_buffer_len < self.max_new_tokens, "overlong_buffer_len",
                      f"must be < max_new_tokens ({self.max_new_tokens})")
        self._at_least("overlong_penalty", 0.0)
        if self.overlong_penalty != 1.0 and not self.overlong_buffer_len:
            raise ValueError(f"rollout.overlong_penalty={self.overlong_penalty} is only used with "
                             "rollout.overlong_buffer_len > 0")


@dataclass
class AsyncConfig(_Section):
    _section: ClassVar[str] = "async_rl"

    alpha: int = 2
    """Asynchronous ratio: max policy versions a sample may lag (trained at V+1 only if its
    generation started at v with V − v <= alpha); 0 = synchronous."""
    stale_policy: str = "drop"
    """What happens to a sample that exceeds alpha: drop | regenerate (re-queue its prompt)."""
    admission: str = "adaptive"
    """How far ahead of training rollout starts samples: adaptive (the default: whole batches, one
    ahead, more — up to alpha — while the trainer keeps waiting; fewer again once a whole batch sits
    finished) | tokens (a fraction of a batch ahead, moved
    by the trainer's waits and the share of the batch's tokens that came late; above one batch only
    after two waits running with the engines also left with nothing admitted: no staleness that buys
    no speed; learned better than adaptive in paired runs, its speed-up not yet measured on a quiet box:
    docs/benchmarks.md) | eager (always alpha batches ahead). The metrics rollout_lookahead
    and admission/* show the choice; buffer/staleness.py "Lookahead" and "Token lookahead" the rules."""
    min_lookahead: float = 1.0
    """admission=tokens only: the least lookahead, in batches (≤ alpha). 1 keeps the next batch generated
    while this one trains; below 1 part of it starts only after the push — fresher tokens, paid for by
    the trainer's wait for them (the rule rises again when the wait passes 5 % of the step)."""
    batch_timeout_s: float = 600.0
    """The trainer stops with an error (after saving what it can) when no full batch arrives for
    this long."""

    def validate(self) -> None:
        self._at_least("alpha", 0)
        self._one_of("stale_policy", STALE_POLICIES)
        self._one_of("admission", ADMISSIONS)
        if self.alpha == 0 and self.admission == "eager":
            raise ValueError(f"async_rl.admission={self.admission!r} needs async_rl.alpha >= 1 (at alpha=0 rollout "
                             "never runs ahead, so there is nothing to admit early)")
        self._at_least("min_lookahead", 0.0)
        self._require(self.admission == "tokens" or self.min_lookahead == 1.0, "min_lookahead",
                      f"is used only with async_rl.admission=tokens (got admission={self.admission!r})")
        self._require(self.min_lookahead <= max(self.alpha, 1), "min_lookahead",
                      f"must be <= async_rl.alpha ({self.alpha})")
        self._positive("batch_timeout_s")


@dataclass
class EngineConfig(_Section):
    _section: ClassVar[str] = "engines"

    backend: str = "local"
    """local (built-in engine server, CPU or one GPU) | sglang (launched here) | attach (already running at urls)."""
    num_engines: int = 1
    """Engine servers to launch (local|sglang); with attach, the length of urls."""
    urls: List[str] = field(default_factory=list)
    """Base URLs of running engines (attach only), e.g. http://node3:30000."""
    host: str = "127.0.0.1"
    """Interface launched engines bind to."""
    base_port: int = 30000
    """Port of engine 0; engine i listens on base_port + i."""
    tp_size: int = 1
    """Tensor-parallel GPUs per engine (sglang/attach; must be 1 for local)."""
    gpu_ids: List[int] = field(default_factory=list)
    """GPUs for launched sglang engines, num_engines × tp_size of them, engine i taking the i-th
    block; empty = the GPUs after the trainer's local ranks."""
    max_inflight_per_engine: int = 64
    """Requests the scheduler keeps in flight per engine (queue-scheduling slots)."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for an engine's /health after launch."""
    request_timeout_s: float = 600.0
    """Seconds before one HTTP request to an engine is abandoned."""
    server_args: Dict[str, Any] = field(default_factory=dict)
    """Extra SGLang flags, passed verbatim as --key value (e.g. {mem-fraction-static: 0.8})."""
    api_key: Optional[str] = None
    """Bearer token for the engines' HTTP API; null = none. Redacted when a config is printed."""
    colocate: bool = False
    """Engines share the trainer's GPUs, time-shared: before each train step the engines are paused
    and release their memory (weights, KV cache, CUDA graphs: SGLang's /release_memory_occupation;
    launched SGLang engines get --enable-memory-saver), after it they take the weights back, receive
    the new ones, then the KV cache, and generate again. Needs async_rl.alpha=0."""
    max_restarts: int = 3
    """Launched engines (local|sglang) that exit are started again up to this many times each, then
    synced to the trainer's weights at the next push before they serve; 0 = never. Attached engines
    are not started here (the multi-node template's launch/slurm/engine_loop.sh restarts them on their
    node); they are watched instead (attach_probe_*)."""
    down_timeout_s: float = 600.0
    """The rollout side stops the run with an error (every rank saves what training reached) when no
    engine request has succeeded for this long, e.g. every engine down and none restarted."""
    attach_probe_interval_s: float = 2.0
    """backend=attach: seconds between /health probes of each attached engine."""
    attach_probe_failures: int = 3
    """backend=attach: this many failed /health probes in a row (5 s timeout each) take the engine out of
    routing; when it answers again it is synced at the next push and re-admitted."""

    def validate(self) -> None:
        self._one_of("backend", ENGINE_BACKENDS)
        self._at_least("max_restarts", 0)
        self._positive("attach_probe_interval_s")
        self._at_least("attach_probe_failures", 1)
        self._at_least("num_engines", 1)
        self._at_least("tp_size", 1)
        self._at_least("max_inflight_per_engine", 1)
        self._positive("startup_timeout_s")
        self._positive("request_timeout_s")
        self._positive("down_timeout_s")
        self._require(bool(self.host), "host", "must be a non-empty host name")
        self._require(1 <= self.base_port and self.base_port + self.num_engines - 1 <= 65535,
                      "base_port", f"must leave room for engines.num_engines={self.num_engines} ports "
                      "in 1..65535")
        if self.backend == "attach":
            self._require(len(self.urls) > 0, "urls", "must list the engine URLs when engines.backend=attach")
            self._require(len(self.urls) == self.num_engines, "num_engines",
                          f"must equal len(engines.urls)={len(self.urls)} when engines.backend=attach "
                          "(set both)")
            # Attached servers were started elsewhere: launch settings here would silently do nothing.
            self._require(not self.gpu_ids, "gpu_ids", "must be empty with engines.backend=attach")
            self._require(not self.server_args, "server_args",
                          "must be empty with engines.backend=attach (pass flags where the servers start)")
        else:
            self._require(not self.urls, "urls", "is only used with engines.backend=attach")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engines.urls entries must start with http:// or https://, got {url!r}")
        if self.backend == "local":
            self._require(self.tp_size == 1, "tp_size", "must be 1 with engines.backend=local")
            self._require(not self.gpu_ids, "gpu_ids", "must be empty with engines.backend=local")
        if self.backend == "sglang" and self.gpu_ids:
            self._require(len(self.gpu_ids) == self.num_engines * self.tp_size, "gpu_ids",
                          f"must hold engines.num_engines × engines.tp_size = "
                          f"{self.num_engines * self.tp_size} GPU ids")
        for key in self.server_args:
            flag = str(key).lstrip("-").replace("_", "-")
            if flag in _ENGINE_OWNED_FLAGS:
                raise ValueError(f"engines.server_args.{key} is set from {_ENGINE_OWNED_FLAGS[flag]}; "
                                 "remove it from engines.server_args")


@dataclass
class WeightSyncConfig(_Section):
    _section: ClassVar[str] = "weight_sync"

    transport: str = "ipc"
    """Trainer→engine path: ipc (CUDA IPC / shared memory; same node) | broadcast (NCCL/gloo
    group with the engines; any node) | disk (safetensors through the filesystem)."""
    bucket_mb: int = 512
    """Size of one transfer bucket, in MiB."""
    probe: bool = True
    """After each sync, score fixed token sequences teacher-forced on every synced engine and on the
    trainer; the report carries max and mean |Δ logprob| (logged as train_infer_logprob_diff)."""
    probe_threshold: float = 0.05
    """Max mean |Δ logprob| per token the probe tolerates before raising WeightSyncError (fp32 gives
    ~1e-5, bf16 ~1e-2; wrong or partial weights give O(1))."""
    max_resync: int = 1
    """An engine that failed midway (it may hold part of the buckets) and still answers is re-synced
    from scratch up to this many times; 0 = never. Engines that stay failed are taken out of service."""
    timeout_s: float = 600.0
    """Deadline of each weight-sync call to an engine (pause, one bucket, version update, probe); on
    expiry the engine is counted as failed for this sync (re-synced or taken out, as above) and the
    error names the engine, the endpoint and the deadline."""
    fail_fast: bool = False
    """Raise WeightSyncError (naming the engine and the step) when an engine is taken out of service;
    false = carry on with the others and list it in SyncReport.failed_urls. A sync that leaves no
    engine serving the new weights always raises."""
    lora: str = "auto"
    """With model.lora: what a push sends. merged: W + (alpha/r)·B·A formed in float32 and cast once to
    the model dtype, a full-weight push any engine takes; adapter: only the adapter tensors (PEFT
    names, a versioned adapter name), which the local engine merges into its own float32-exact copy
    of the base and SGLang loads through its LoRA API (ipc or disk transport); auto: adapter with
    engines.backend=local (not colocated), merged otherwise. Refused without model.lora."""

    def validate(self) -> None:
        self._one_of("transport", WEIGHT_TRANSPORTS)
        self._one_of("lora", LORA_SYNC_MODES)
        self._at_least("bucket_mb", 1)
        self._positive("probe_threshold")
        self._at_least("max_resync", 0)
        self._positive("timeout_s")


@dataclass
class AgenticConfig(_Section):
    _section: ClassVar[str] = "agentic"

    env: str = ""
    """Environment name (frozenlake, sokoban, calculator, yours) or "module:Class"; empty = RLVR
    (single-turn prompts from `data`). With an env, rollout.n_samples_per_prompt is the group size:
    that many episodes of the same env seed form one group."""
    env_params: Dict[str, Any] = field(default_factory=dict)
    """Keyword parameters passed verbatim to the environment, e.g. {size: 4, max_steps: 8}."""
    max_turns: int = 8
    """Model turns per episode; the episode ends (done=false) after the last one."""
    max_tokens_per_turn: int = 32
    """Longest model reply in one turn, in tokens."""
    max_episode_tokens: int = 256
    """Model + observation tokens after the first prompt. An observation that would exceed it ends
    the episode (counted as truncated; its tokens are not added)."""
    redundancy: int = 0
    """Extra episodes per group: group_size + redundancy start, the first group_size to finish form
    the group, the rest are cancelled (their engine requests aborted)."""
    reset_timeout_s: float = 60.0
    """An env reset taking longer fails the episode (counted; the run continues)."""
    step_timeout_s: float = 60.0
    """An env step taking longer fails the episode (counted; the run continues)."""
    system_prompt: str = ""
    """Optional system message before the first observation (rendered with the chat template)."""
    latency: Dict[str, Any] = field(default_factory=dict)
    """Latency/failure injection for tests and benchmarks, e.g. {step_latency: {dist: normal,
    mean_s: 0.05, std_s: 0.05}, failure_prob: 0.01}; empty = none."""
    seed: int = 0
    """First environment seed; group g uses seed + (its dataset index)."""
    num_seeds: int = 0
    """0 = a new env seed for every group; N > 0 = cycle through seeds seed … seed + N − 1 (a fixed
    task set, e.g. to watch a tiny model learn a few maps)."""
    workflow: str = ""
    """An agent written against the OpenAI API, as "module:function": an async function
    (base_url, api_key, task) → reward or (reward, info), run once per episode against the run's
    agent gateway (megatron_flash/agentic/workflow.py). Tasks come from `data`; exclusive with `env`."""
    workflow_timeout_s: float = 300.0
    """An episode whose workflow runs longer fails (counted; the run continues)."""
    gateway_port: int = 0
    """Port of the run's agent gateway on 127.0.0.1 (0 = a free one)."""
    gateway_tool_parser: str = "hermes"
    """How the gateway reads tool calls out of the model's text (registry in agentic/gateway/tool_parsers.py)."""

    WORKFLOW_ONLY: ClassVar[tuple] = ("workflow_timeout_s", "gateway_port", "gateway_tool_parser")
    ENV_ONLY: ClassVar[tuple] = ("env_params", "max_turns", "max_episode_tokens", "reset_timeout_s", "step_timeout_s",
                "system_prompt", "latency", "seed", "num_seeds")

    def validate(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_episode_tokens"):
            self._at_least(name, 1)
        self._positive("workflow_timeout_s")
        self._at_least("gateway_port", 0)
        self._one_of("gateway_tool_parser", TOOL_PARSER_NAMES)
        if not self.workflow:
            defaults = type(self)()
            for name in self.WORKFLOW_ONLY:
                self._require(getattr(self, name) == getattr(defaults, name), name,
                              "is used with agentic.workflow only, which is not set")
        if self.workflow:
            self._require(not self.env, "workflow", "and agentic.env are exclusive (an episode is one or the other)")
            self._require(":" in self.workflow, "workflow", "must be 'module:function'")
            defaults = type(self)()
            for name in self.ENV_ONLY:
                self._require(getattr(self, name) == getattr(defaults, name), name,
                              "is used by agentic.env episodes only, and agentic.workflow is set")
        self._at_least("redundancy", 0)
        self._positive("reset_timeout_s")
        self._positive("step_timeout_s")
        self._at_least("seed", 0)
        self._at_least("num_seeds", 0)


@dataclass
class DataConfig(_Section):
    _section: ClassVar[str] = "data"

    path: str = ""
    """Prompt file (.jsonl, .json or .parquet), a dataset directory, or a Hub dataset id ("org/name",
    resolved through the Hugging Face cache like model.hf_path); takes precedence over task."""
    split: str = "train"
    """The split read from a dataset directory or Hub dataset; a single file is one split (train)."""
    prompt_key: str = "prompt"
    """Column/field holding the prompt text."""
    answer_key: str = "answer"
    """Column/field holding the reference answer the reward compares with."""
    task: str = ""
    """Built-in synthetic task (e.g. sort4) used when path is empty."""
    task_args: Dict[str, Any] = field(default_factory=dict)
    """Settings of the built-in task; only arith takes any (digits, operations, word_problems,
    non_negative: rewards/arith.py)."""
    num_samples: int = 0
    """Prompts to use from the dataset; 0 = all (synthetic tasks: their default size)."""
    shuffle: bool = True
    """Shuffle prompt order each epoch (seeded by trainer.seed)."""
    apply_chat_template: bool = False
    """Wrap each prompt as one user message in the tokenizer's chat template (with the generation
    prompt) before tokenizing; false = tokenize the raw prompt text."""
    max_prompt_len: int = 0
    """Longest prompt kept, in tokens (after the chat template); longer ones are skipped and
    counted. 0 = no limit."""

    def validate(self) -> None:
        self._require(bool(self.prompt_key), "prompt_key", "must be non-empty")
        self._require(bool(self.answer_key), "answer_key", "must be non-empty")
        self._at_least("num_samples", 0)
        self._at_least("max_prompt_len", 0)
        self._require(bool(self.split), "split", "must be non-empty")
        if self.split != "train" and os.path.splitext(self.path)[1].lower() in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"data.split={self.split!r}: data.path={self.path!r} is a single file, which holds one "
                             "split (train); a split is chosen from a dataset directory or Hub dataset id")
        if self.task:
            self.task_args = check_task(self.task, self.task_args, key="data.task_args")
        elif self.task_args:
            raise ValueError(f"data.task_args is set, but data.task is empty (only the built-in task "
                             f"{', '.join(TASKS_WITH_ARGS)} takes settings)")


@dataclass
class EvalConfig(_Section):
    _section: ClassVar[str] = "eval"

    datasets: Dict[str, Any] = field(default_factory=dict)
    """Held-out sets by name, each a mapping of `data` fields (path, prompt_key, answer_key, task,
    num_samples, apply_chat_template, max_prompt_len); empty = no evaluation. Synthetic tasks are
    drawn with another seed than training's."""
    every_steps: int = 0
    """Evaluate after every this many steps; always at step 0 (before training) and after the last."""
    n_samples: int = 4
    """Responses per prompt: mean@n and the unbiased pass@k for k = 1, 2, 4, …, n."""
    max_new_tokens: int = 0
    """Longest evaluation response; 0 = rollout.max_new_tokens."""
    temperature: float = 1.0
    """Sampling temperature of evaluation requests."""
    correct_threshold: float = 1.0
    """A response counts as correct (pass@k) when its reward is at least this."""

    def validate(self) -> None:
        if not isinstance(self.datasets, dict):
            raise ValueError(f"eval.datasets must be a mapping of name → data fields, got {type(self.datasets).__name__}")
        allowed = ("path", "prompt_key", "answer_key", "task", "task_args", "num_samples", "apply_chat_template",
                   "max_prompt_len")
        for name, spec in self.datasets.items():
            if not isinstance(spec, dict):
                raise ValueError(f"eval.datasets.{name} must be a mapping of data fields ({', '.join(allowed)})")
            unknown = sorted(set(spec) - set(allowed))
            if unknown:
                raise ValueError(f"eval.datasets.{name}.{unknown[0]} is not a data field ({', '.join(allowed)})")
            if not spec.get("path") and not spec.get("task"):
                raise ValueError(f"eval.datasets.{name} needs a path or a task")
            if spec.get("task"):  # named here by its own key, not as data.task_args
                spec["task_args"] = check_task(spec["task"], spec.get("task_args") or {},
                                               key=f"eval.datasets.{name}.task_args")
            elif spec.get("task_args"):
                raise ValueError(f"eval.datasets.{name}.task_args is set, but eval.datasets.{name}.task is empty")
            try:
                DataConfig(**spec).validate()
            except ValueError as error:  # name the evaluation set, not the training data
                raise ValueError(f"eval.datasets.{name}: {error}") from None
        self._at_least("every_steps", 0)
        self._at_least("n_samples", 1)
        self._at_least("max_new_tokens", 0)
        self._positive("temperature")
        if not self.datasets:
            changed = [f.name for f in fields(self) if f.name != "datasets" and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"eval.{changed[0]} is set but eval.datasets is empty (nothing to evaluate)")


@dataclass
class LoggingConfig(_Section):
    _section: ClassVar[str] = "logging"

    dir: str = "runs/default"
    """Run directory: resolved config, metrics, TensorBoard and W&B files."""
    wandb_mode: str = "offline"
    """offline (files under dir, sync later) | online | disabled."""
    wandb_project: str = "megatron-flash"
    """W&B project name."""
    tensorboard: bool = True
    """Also write TensorBoard event files under dir."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    trace: bool = False
    """Write the run's timeline to dir/trace.json (Chrome trace-event format: Perfetto, chrome://tracing):
    trainer rank 0's stages, the weight push's phases, every engine request, rewards, buffer admission
    and drops, env steps (megatron_flash/trace.py). Off: nothing is recorded."""
    trace_rotate_steps: int = 100
    """With trace: each file covers this many steps (trace.json, then trace.1.json, ...), so each stays
    bounded on a long run."""

    def validate(self) -> None:
        self._require(bool(self.dir), "dir", "must be a non-empty directory")
        self._one_of("wandb_mode", WANDB_MODES)
        self._at_least("log_interval", 1)
        self._at_least("trace_rotate_steps", 1)
        self._require(self.trace or self.trace_rotate_steps == 100, "trace_rotate_steps",
                      "takes effect only with logging.trace=true")


@dataclass
class CheckpointConfig(_Section):
    _section: ClassVar[str] = "checkpoint"

    save_dir: str = ""
    """Directory for Megatron (distributed) checkpoints; empty = no checkpoints."""
    save_interval: int = 0
    """Save every this many optimizer steps; 0 = never during training."""
    resume: bool = False
    """Resume from the latest checkpoint in save_dir (model, optimizer, policy version, data order)."""
    save_hf_at_end: bool = True
    """Export HF safetensors at the end (under save_dir, else logging.dir)."""
    save_hf_interval: int = 0
    """Export an HF checkpoint every this many steps to {save_dir, else logging.dir}/hf/step_NNNNNN
    (atomically) and point the symlink hf/latest at it; 0 = never."""

    def validate(self) -> None:
        self._at_least("save_interval", 0)
        self._at_least("save_hf_interval", 0)
        if self.save_interval > 0:
            self._require(bool(self.save_dir), "save_dir", "must be set when checkpoint.save_interval > 0")
        if self.resume:
            self._require(bool(self.save_dir), "save_dir", "must be set when checkpoint.resume=true")


@dataclass
class DistillConfig(_Section):
    """On-policy distillation (OPD): a teacher scores the student's own sampled tokens, and the per-token
    reverse-KL estimate k_t = log π_student(y_t) − log π_teacher(y_t) enters the advantage:
    Â_t = A_t − coef · k_t with mode=add, −coef · k_t alone with mode=only (losses/distill.py). Off
    while `teacher` is empty."""

    _section: ClassVar[str] = "distill"

    teacher: str = ""
    """The teacher checkpoint (HF dir or Hub id); it must share the student's tokenizer. Launched as
    its own engines (the student's engines.backend, local or sglang) unless `urls` lists running ones."""
    urls: List[str] = field(default_factory=list)
    """Base URLs of teacher engines already serving `teacher` (attached); empty = launch them here."""
    coef: float = 1.0
    """λ: weight of the per-token reverse-KL term in the advantage."""
    mode: str = "add"
    """add (the KL term added to the task advantage) | only (the KL term alone; rewards are still
    computed and logged)."""
    student_logprobs: str = "current"
    """current (log π_student from the training forward, the policy being trained; no extra forward) |
    behavior (the student engine's logprob when it sampled the token, up to async_rl.alpha versions
    old: at α = 2 it pushed a sort4 student into ending its answers early)."""
    topk: int = DEFAULT_DISTILL_TOPK
    """K > 0 (the default): the teacher scores its K most likely tokens at every response position too
    (SGLang `top_logprobs_num`; the local engine answers it on its scoring requests), and the loss gains
    coef · the reverse KL over those K tokens plus the rest of the vocabulary, from the training forward
    (losses/distill.py); the task advantage stays (add) or is dropped (only). Needs
    student_logprobs=current. 0: only the sampled-token estimate k_t in the advantage (above), which
    collapses on stale samples (measured on sort4: the student's reward fell to 0 at async_rl.alpha >= 1
    while top-K learned; docs/benchmarks.md), so at alpha > 0 it needs allow_sampled_estimate."""
    allow_sampled_estimate: bool = False
    """Run topk=0 (the sampled-token estimate alone) at async_rl.alpha > 0 anyway, as loss.allow_uncorrected
    does for an uncorrected loss: measuring it is the only reason to."""
    num_engines: int = 1
    """Teacher engines to launch; with urls, the length of urls."""
    base_port: int = 31000
    """Port of launched teacher engine 0; engine i listens on base_port + i."""
    server_args: Dict[str, Any] = field(default_factory=dict)
    """Flags for the launched teacher engines, as engines.server_args is for the student's."""

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    def validate(self) -> None:
        self._one_of("mode", DISTILL_MODES)
        self._one_of("student_logprobs", DISTILL_STUDENT_LOGPROBS)
        self._positive("coef")
        self._at_least("num_engines", 1)
        self._at_least("topk", 0)
        self._require(not (self.topk and self.student_logprobs != "current"), "topk",
                      "must be 0 with distill.student_logprobs=behavior: the top-K reverse KL is taken from the "
                      "training forward (student_logprobs=behavior has only the sampled token's logprob)")
        self._require(1 <= self.base_port and self.base_port + self.num_engines - 1 <= 65535, "base_port",
                      f"must leave room for distill.num_engines={self.num_engines} ports in 1..65535")
        if not self.enabled:
            for name, default in (("urls", []), ("coef", 1.0), ("mode", "add"), ("student_logprobs", "current"),
                                  ("topk", DEFAULT_DISTILL_TOPK), ("allow_sampled_estimate", False),
                                  ("num_engines", 1), ("base_port", 31000), ("server_args", {})):
                if getattr(self, name) != default:
                    raise ValueError(f"distill.{name} is set but distill.teacher is empty: distillation is off "
                                     "(set distill.teacher to the teacher checkpoint)")
            return
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"distill.urls entries must start with http:// or https://, got {url!r}")
        if self.urls:
            self._require(len(self.urls) == self.num_engines, "num_engines",
                          f"must equal len(distill.urls)={len(self.urls)} (set both)")
            self._require(not self.server_args, "server_args",
                          "must be empty with distill.urls (pass flags where the teacher servers start)")


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
