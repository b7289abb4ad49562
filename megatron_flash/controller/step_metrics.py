"""One metrics row per optimizer step (rank 0): rewards, lengths, staleness, the cumulative sample
accounting, stage times, rollout and engine counters, train/infer mismatch, the labelled-version check,
the weight push and the trainer's own metrics; logged through the Tracker with the step's histograms,
and the trained-prompt ledger line that resume and the accounting tests read.

Accounting identity of every row: samples_admitted = samples_trained + samples_outstanding + every drop
and skip counter (dropped_stale, regenerated_stale, dropped_filtered, reward_failed, dropped_error,
samples_skipped, samples_cancelled).
"""

from __future__ import annotations

import collections
import json
import os
from typing import TYPE_CHECKING, Any, Optional

from megatron_flash import recipes
from megatron_flash.controller.checkpoints import LEDGER
from megatron_flash.trace import TRACER, busy_fraction
from megatron_flash.types import Group, TrainBatch

if TYPE_CHECKING:
    from megatron_flash.buffer.staleness import StalenessManager
    from megatron_flash.config.schema import RolloutConfig
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.tracking import Tracker


class StepRecorder:
    """Builds and writes each step's row; the loop hands it what the step produced."""

    def __init__(self, *, run_dir: str, tracker: "Tracker", rollout_cfg: "RolloutConfig") -> None:
        self.run_dir = run_dir
        self.tracker = tracker
        self.rollout_cfg = rollout_cfg
        self.skipped_at_load = 0  # prompts that could never fit the engines' context

    def record(self, step: int, *, version: int, groups: list[Group], batch: TrainBatch,
               staleness: "StalenessManager", runtime: Optional["RolloutRuntime"], overlong: dict[str, int],
               checks: dict[str, float],
               sync_metrics: dict[str, float], train_metrics: dict[str, float],
               t_wait: float, t_train: float, t_step: float,
               train_window_ns: Optional[tuple[int, int]] = None) -> dict[str, Any]:
        """`version` is the policy version after this step's push; `overlong` and `checks` are the
        loop's own per-step counts (the overlong filter, the labelled-version check);
        `train_window_ns` the monotonic ns from the batch's arrival to the last optimizer step's end."""
        samples = [s for g in groups for s in g.samples]
        lags = [version - 1 - s.version_start for s in samples]
        c = staleness.snapshot()
        m: dict[str, Any] = {
            "version": version,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) if s.response_mask is None else sum(s.response_mask)
                                     for s in samples) / len(samples),  # model tokens only
            "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
            "dropped_stale": c.dropped_stale, "regenerated_stale": c.regenerated_stale,
            "dropped_filtered": c.dropped_filtered, "reward_failed": c.dropped_failed,
            # Cumulative sample accounting: admitted = trained + outstanding + every drop and skip.
            "samples_admitted": c.submitted, "samples_trained": c.consumed, "samples_outstanding": c.outstanding,
            "samples_skipped": c.skipped, "dropped_error": c.dropped_error, "samples_cancelled": c.cancelled,
            "time_rollout_wait": t_wait, "time_train": t_train, "time_step": t_step,
            "samples_per_s": len(samples) / max(t_step, 1e-9),
            "overlong_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            **overlong,
        }
        mismatch, histograms = recipes.mismatch_metrics(batch)
        if "train_infer_logprob_diff" in sync_metrics:  # the probe's, when it ran, is the one logged
            mismatch.pop("train_infer_logprob_diff", None)
        m.update(mismatch)
        m.update({f"staleness/samples_{lag}": count for lag, count in sorted(collections.Counter(lags).items())})
        if runtime is not None:
            m.update(self._rollout_metrics(runtime, t_step))
            m.update(self._pipeline_metrics(runtime, train_window_ns))
        m.update(recipes.length_bias(samples, staleness.take_drop_lengths()))
        m.update(recipes.token_staleness(samples, version - 1))
        m.update(recipes.distill_metrics(samples))
        m["rollout_lookahead"] = c.lookahead
        # What admission saw at this step's take (buffer/staleness.py "Token lookahead").
        m["admission/late_share"], m["admission/starved_s"], m["admission/sit_s"] = c.late_share, c.starved_s, c.sit_s
        m.update(checks)
        m.update(sync_metrics)
        m.setdefault("train_infer_logprob_diff", None)  # neither a probe nor fresh samples this step
        m.setdefault("mismatch_k3", None)  # no fresh sample, or a loss without π_prox
        m.setdefault("mismatch_log_ppl_gap", None)
        m.update(train_metrics)
        self.tracker.log(step, m)
        histograms["length/trained"] = [len(s.response_ids) for s in samples]
        self.tracker.log_histograms(step, histograms)
        with open(os.path.join(self.run_dir, LEDGER), "a") as f:  # which prompts each step trained
            f.write(json.dumps({"step": step, "version": version,
                                "prompt_indices": sorted(g.prompt_index for g in groups)}) + "\n")
        return m

    def _rollout_metrics(self, runtime: "RolloutRuntime", t_step: float) -> dict[str, Any]:
        stats, engine = runtime.take_metrics()
        m: dict[str, Any] = dict(engine)
        m["tokens_per_s"] = stats.tokens_generated / max(t_step, 1e-9)
        m["rollout_resumes"] = stats.resumes
        m["engine_errors"] = stats.engine_errors
        m["reward_overflow"] = stats.reward_overflow  # samples beyond ±REWARD_LIMIT: within reward_failed
        m["reward_errors"] = stats.reward_errors  # failed reward calls, per call (reward_failed: dropped samples)
        m["reward_timeouts"] = stats.reward_timeouts
        m["skipped_prompts"] = stats.skipped_prompts  # refused (4xx) or failing past max_prompt_retries
        m["skipped_after_retries"] = stats.skipped_after_retries
        m["skipped_prompts_at_load"] = self.skipped_at_load  # could never fit the engines
        m["groups_expired_in_flight"] = stats.groups_expired  # redundant surplus cancelled at a push
        if self.rollout_cfg.overlong_buffer_len:
            m["overlong_penalized"] = stats.overlong_penalized
            m["overlong_penalty_mean"] = stats.overlong_penalty_sum / max(stats.overlong_penalized, 1)
        return m


    @staticmethod
    def _pipeline_metrics(runtime: "RolloutRuntime", window: Optional[tuple[int, int]]) -> dict[str, float]:
        """pipeline/overlap: the fraction of the trainer's busy time (batch in hand → last optimizer step
        done) during which at least one engine request was in flight — the asynchronous gain (≈ 0 at
        α = 0, where generation and training alternate). From the same request intervals as the trace."""
        done, open_starts, now, events = runtime.take_activity()
        TRACER.add(events)  # a rollout process's trace events (its own clock is this one)
        if window is None:
            return {}
        return {"pipeline/overlap": busy_fraction(done, open_starts, lo=window[0], hi=window[1], now=now)}


def where_samples_went(staleness: "StalenessManager", rollout_cfg: "RolloutConfig") -> str:
    """Why a batch never filled: every sample admitted so far, by what became of it."""
    c, r = staleness.snapshot(), rollout_cfg
    return (f"of {c.submitted} samples admitted, {c.consumed} trained, {c.outstanding} in flight or buffered, "
            f"{c.dropped_filtered} dropped by rollout.dynamic_filter={r.dynamic_filter}, {c.dropped_failed} by "
            f"failed rewards, {c.dropped_stale + c.regenerated_stale} stale, {c.dropped_error} by engine errors, "
            f"{c.skipped} skipped (refused or failing prompts)")
