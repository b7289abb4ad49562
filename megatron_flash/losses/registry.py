"""Loss registry: losses are picked by name, configured by keyword parameters, validated up front.

A loss is registered as a *factory*: a function (or class) whose parameters are keyword
parameters of the loss and which returns a formula ``fn(batch: LossInputs) -> LossTerms``::

    @register_loss("scaled_reinforce")
    def scaled_reinforce(*, scale: float = 1.0) -> LossFn:
        def fn(batch: LossInputs) -> LossTerms:
            return LossTerms(-scale * batch.advantages * batch.logprobs, {})
        return fn

``get_loss(name, **params)`` splits ``params`` into the common ones (mismatch masking, KL; see
``corrections.COMMON_PARAMS``) and the factory's own, calls the factory, and wraps the formula in a
``Loss``: the callable the trainer uses. ``Loss`` resolves a missing proximal policy, applies the
mismatch mask and the KL term, zeroes every token it does not train, and adds the shared metrics.

Each registration also declares what the formula assumes about the data: ``on_policy=True`` for a
formula whose ratio (or gradient) has no correction for the behaviour policy μ that sampled the
tokens, so it is right only when μ is the policy being trained (a run refuses it on stale samples
unless told otherwise), and ``describe``, one line saying which policy each ratio is taken against
and which correction applies (a run logs it at start). Both may be functions of the resolved
parameters, for a loss whose correction is an option.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, TypeVar, Union

import torch

from megatron_flash.losses.common import (
    LossFn,
    LossInputs,
    LossTerms,
    clamped_log_ratio,
    masked_frac,
    masked_mean,
)
from megatron_flash.losses.corrections import COMMON_PARAMS, CommonParams, kl_penalty, mismatch_keep

Factory = TypeVar("Factory", bound=Callable[..., LossFn])
OnPolicy = Union[bool, Callable[[Mapping[str, object]], bool]]
Describe = Union[str, Callable[[Mapping[str, object]], str]]
"""A ``str.format`` template over the loss's parameters, or a function of them."""


class _Entry:
    """A registered factory with its parameter names (required ones have no default)."""

    def __init__(self, *, factory: Callable[..., LossFn], needs_proximal: bool, on_policy: OnPolicy,
                 describe: Describe) -> None:
        self.factory = factory
        self.needs_proximal = needs_proximal
        self.on_policy = on_policy
        self.describe = describe
        self.params: dict[str, inspect.Parameter] = dict(inspect.signature(factory).parameters)

    def is_on_policy(self, params: Mapping[str, object]) -> bool:
        return bool(self.on_policy(params) if callable(self.on_policy) else self.on_policy)

    def description(self, params: Mapping[str, object]) -> str:
        if callable(self.describe):
            return str(self.describe(params))
        if self.describe:
            try:
                return self.describe.format(**params)
            except (KeyError, IndexError) as e:  # a user's template: a ValueError the launcher reports
                raise ValueError(f"describe template {self.describe!r} names {e}, not a parameter of the loss") from None
        if self.is_on_policy(params):
            return "no description registered; behaviour correction: none (registered on_policy=True)"
        return "no description registered; treated as correcting for the behaviour policy (on_policy=False)"


_REGISTRY: dict[str, _Entry] = {}


def register_loss(
    name: str, *, needs_proximal: bool = False, on_policy: OnPolicy = False, describe: Describe = ""
) -> Callable[[Factory], Factory]:
    """Decorator registering a loss factory under ``name``.

    Args:
        name: the name configs use; must be new.
        needs_proximal: whether the formula reads ``proximal_logprobs`` (the trainer then runs the
            extra forward pass at the start of each step).
        on_policy: True when nothing in the formula corrects for the behaviour policy μ (its ratio
            is against π_prox, or it has none): right only when the samples are on-policy, so a run
            with stale samples (async_rl.alpha > 0) refuses it unless ``loss.allow_uncorrected``.
            A function of the resolved parameters when an option adds the correction.
        describe: one line, logged at the start of a run: which policy each ratio is taken against
            and which behaviour correction applies; a ``str.format`` template over the resolved
            parameters (e.g. ``"... clamp(ρ, {lower}, {upper}) ..."``) or a function of them.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss name must be a non-empty string, got {name!r}")

    def decorate(factory: Factory) -> Factory:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} is already registered")
        entry = _Entry(factory=factory, needs_proximal=needs_proximal, on_policy=on_policy, describe=describe)
        for param in entry.params.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise ValueError(
                    f"loss {name!r}: factory parameter {param.name!r} must be a named keyword parameter"
                )
            if param.name in COMMON_PARAMS:
                raise ValueError(
                    f"loss {name!r}: factory parameter {param.name!r} clashes with a common loss "
                    f"parameter ({', '.join(sorted(COMMON_PARAMS))})"
                )
        _REGISTRY[name] = entry
        return factory

    return decorate


def list_losses() -> list[str]:
    """Registered loss names, sorted."""
    return sorted(_REGISTRY)


def corrected_losses() -> list[str]:
    """Registered losses that correct for the behaviour policy with their default parameters, sorted."""
    out = []
    for name, entry in sorted(_REGISTRY.items()):
        defaults = {key: p.default for key, p in entry.params.items() if p.default is not p.empty}
        try:
            if not entry.is_on_policy(defaults):
                out.append(name)
        except KeyError:  # decided by a required parameter: not corrected by default
            pass
    return out


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(list_losses())}")
    return _REGISTRY[name]


def loss_param_names(name: str) -> set[str]:
    """Every parameter ``get_loss(name, ...)`` accepts: the loss's own plus the common ones."""
    return set(_entry(name).params) | set(COMMON_PARAMS)


def get_loss(name: str, **params: object) -> Loss:
    """Build the loss ``name`` with ``params``; ValueError for unknown names/params or bad values."""
    entry = _entry(name)
    own = {key: value for key, value in params.items() if key not in COMMON_PARAMS}
    for key in own:
        if key not in entry.params:
            raise ValueError(
                f"loss {name!r} got unknown parameter {key!r}; accepted: "
                f"{', '.join(entry.params) or '(none)'}; common to all losses: "
                f"{', '.join(sorted(COMMON_PARAMS))}"
            )
    for key, param in entry.params.items():
        if param.default is param.empty and key not in own:
            raise ValueError(f"loss {name!r} requires parameter {key!r}")
    common = CommonParams.from_params(name, params)
    formula = entry.factory(**own)
    if not callable(formula):
        raise ValueError(f"loss {name!r}: factory returned {formula!r}, which is not callable")
    resolved = {
        key: own.get(key, param.default) for key, param in entry.params.items()
    } | {key: getattr(common, key) for key in sorted(COMMON_PARAMS)}
    return Loss(
        name=name, formula=formula, params=resolved, common=common, needs_proximal=entry.needs_proximal,
        on_policy=entry.is_on_policy(resolved), description=entry.description(resolved),
    )


class Loss:
    """The callable the trainer uses; see ``__call__``.

    Attributes:
        name: registry name.
        params: every parameter value in effect, defaults included (for logging).
        needs_proximal: True when the formula reads π_prox or mismatch masking is on; when False
            the trainer may skip the proximal forward pass and pass ``proximal_logprobs=None``.
        needs_reference: True when ``kl_coef > 0``; the KL term is applied only on calls that
            receive ``reference_logprobs``.
        on_policy: True when nothing in the formula corrects for the behaviour policy μ (see
            ``register_loss``); mismatch masking drops outliers but corrects no ratio.
        description: one line: which policy each ratio is taken against, which behaviour
            correction applies, and the common corrections in effect.
    """

    def __init__(
        self, *, name: str, formula: LossFn, params: dict[str, object], common: CommonParams,
        needs_proximal: bool, on_policy: bool = False, description: str = "",
    ) -> None:
        self.name = name
        self.params = params
        self._formula = formula
        self._common = common
        self.needs_proximal = needs_proximal or common.mismatch_mask != "off"
        self.needs_reference = common.kl_coef > 0
        self.on_policy = on_policy
        self.description = description + common.describe()

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.params.items())
        return f"Loss({self.name!r}, {args})"

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        rewards: torch.Tensor | None = None,
        proximal_logprobs: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss [B, T] (0 wherever a token does not train) and detached 0-dim metrics.

        ``proximal_logprobs=None`` means on-policy: the formula gets ``behavior_logprobs`` in its
        place, and mismatch masking (which compares the two) drops nothing.
        """
        _check_shapes(logprobs, behavior_logprobs, advantages, loss_mask, rewards, proximal_logprobs,
                      reference_logprobs)
        mask = loss_mask != 0
        zeros = torch.zeros_like(logprobs)

        def clean(tensor: torch.Tensor | None, *, detach: bool = True) -> torch.Tensor | None:
            # Padding may hold -inf/NaN; replace it so no NaN reaches values or gradients.
            if tensor is None:
                return None
            tensor = tensor.to(logprobs.dtype)
            return torch.where(mask, tensor.detach() if detach else tensor, zeros)

        behavior = clean(behavior_logprobs)
        proximal = clean(proximal_logprobs)
        effective = mismatch_keep(
            proximal_logprobs=proximal, behavior_logprobs=behavior, loss_mask=mask, params=self._common
        )
        batch = LossInputs(
            logprobs=clean(logprobs, detach=False),
            behavior_logprobs=behavior,
            proximal_logprobs=behavior if proximal is None else proximal,
            advantages=clean(advantages),
            loss_mask=effective,
            rewards=None if rewards is None else rewards.detach(),
            reference_logprobs=clean(reference_logprobs),
        )
        terms = LossTerms(*self._formula(batch))
        if terms.per_token_loss.shape != logprobs.shape:
            raise ValueError(
                f"loss {self.name!r} returned per_token_loss of shape {tuple(terms.per_token_loss.shape)}, "
                f"expected {tuple(logprobs.shape)}"
            )
        trained = effective if terms.keep is None else effective & terms.keep
        per_token = terms.per_token_loss
        metrics = {key: value.detach() for key, value in terms.metrics.items()}
        if batch.reference_logprobs is not None and self._common.kl_coef > 0:
            kl = kl_penalty(
                logprobs=batch.logprobs,
                reference_logprobs=batch.reference_logprobs,
                estimator=self._common.kl_estimator,
            )
            per_token = per_token + self._common.kl_coef * kl
            metrics["kl_ref"] = masked_mean(kl, trained)
        per_token = torch.where(trained, per_token, zeros)
        metrics.update(_shared_metrics(batch, mask=mask, effective=effective, trained=trained))
        return per_token, metrics


def _shared_metrics(
    batch: LossInputs, *, mask: torch.Tensor, effective: torch.Tensor, trained: torch.Tensor
) -> dict[str, torch.Tensor]:
    dtype = batch.logprobs.dtype
    log_ratio = batch.logprobs.detach() - batch.behavior_logprobs
    clamped = clamped_log_ratio(batch.logprobs.detach(), batch.behavior_logprobs)
    sequences = mask.any(dim=-1)
    hit = (mask & ~effective).any(dim=-1)  # a sequence that lost at least one token to mismatch masking
    return {
        "dropped_frac": masked_frac(~trained, mask, dtype),
        "mismatch_dropped_frac": masked_frac(~effective, mask, dtype),
        "mismatch_dropped_seq_frac": (hit & sequences).sum().to(dtype) / sequences.sum().clamp(min=1).to(dtype),
        "loss_dropped_frac": masked_frac(effective & ~trained, mask, dtype),
        # k3 estimate of KL(μ‖π_θ) from tokens sampled by μ: (r − 1) − log r, r = π_θ/μ.
        "approx_kl": masked_mean(torch.exp(clamped) - 1.0 - clamped, trained),
        "mismatch_abs": masked_mean(log_ratio.abs(), trained),
        "num_trained_tokens": trained.sum().to(dtype),
    }


def _check_shapes(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rewards: torch.Tensor | None,
    proximal_logprobs: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    named = {
        "behavior_logprobs": behavior_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "proximal_logprobs": proximal_logprobs,
        "reference_logprobs": reference_logprobs,
    }
    for key, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"{key} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(tensor.shape)}"
            )
    if rewards is not None and rewards.shape != logprobs.shape[:1]:
        raise ValueError(f"rewards must be [B] = [{logprobs.shape[0]}], got shape {tuple(rewards.shape)}")
