"""Sampling and rollout scheduling (`rollout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section

DYNAMIC_FILTERS = ("none", "nonzero_std")  # built-ins; "module:function" names a user filter
PAUSE_MODES = ("abort", "retract", "in_place")
ROLLOUT_RUNNERS = ("thread", "process")


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
    min_new_tokens: int = 0
    """Shortest response: the engines do not end a response (EOS or stop tokens) before this many
    tokens (SGLang's sampling param of the name). The local engine reports the logprobs of what it
    sampled from, stop tokens masked (the behaviour μ), while the trainer scores the unmasked policy:
    each forced token's importance ratio carries 1 − p(stop), and the mismatch metrics rise by about
    p(stop). Keep it for tasks that need long responses. Rollout only (evaluation samples freely).
    0 = off."""
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
        self._at_least("min_new_tokens", 0)
        self._require(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                      f"must be <= max_new_tokens ({self.max_new_tokens})")
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
