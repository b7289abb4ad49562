"""Policy loss, aggregation and advantages (`loss`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict

from megatron_flash.config.sections.base import _Section

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
ADVANTAGES = ("grpo", "rloo", "reinforce")
PROX_LOGPROBS = ("recompute", "approximate")
KL_ESTIMATORS = ("k1", "k3")


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
