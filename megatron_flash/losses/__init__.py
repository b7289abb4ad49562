"""Per-token RL losses picked by name, advantage estimators, and Megatron-style aggregation.

Pure torch + stdlib (never Megatron). Usage::

    loss = get_loss("decoupled_ppo", eps_high=0.28, weight_cap=5.0, mismatch_mask="token")
    per_token, metrics = loss(logprobs=..., behavior_logprobs=..., proximal_logprobs=...,
                              advantages=..., loss_mask=..., rewards=...)
    loss_sum, denominator = aggregate(per_token, loss_mask, mode="token_mean")

See docs/losses.md for the formulas, parameters and metrics.
"""

from megatron_flash.losses.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megatron_flash.losses.aggregation import AGGREGATION_MODES, aggregate
from megatron_flash.losses.common import LOG_RATIO_CLAMP, LossFn, LossInputs, LossTerms
from megatron_flash.losses.corrections import COMMON_PARAMS, KL_ESTIMATORS, MISMATCH_MODES
from megatron_flash.losses.distill import DISTILL_MODES, STUDENT_LOGPROBS, distill_advantages, topk_reverse_kl
from megatron_flash.losses.registry import Loss, get_loss, list_losses, loss_param_names, register_loss

# Importing a loss module registers it.
from megatron_flash.losses import cispo, decoupled_ppo, gspo, ppo, reinforce, tis, topr  # noqa: E402,F401

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "COMMON_PARAMS",
    "DISTILL_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "MISMATCH_MODES",
    "STUDENT_LOGPROBS",
    "Loss",
    "LossFn",
    "LossInputs",
    "LossTerms",
    "aggregate",
    "compute_advantages",
    "distill_advantages",
    "topk_reverse_kl",
    "get_loss",
    "list_losses",
    "loss_param_names",
    "register_loss",
]
