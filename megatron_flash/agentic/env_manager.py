"""Multi-turn episodes against environments: env-level async and redundant env rollout.

Every environment instance runs its own asyncio task (env-level async): generate the next action
through the proxy, parse it, step the environment, append the observation, repeat — no episode
waits for another one's model call or environment step. A group starts group_size + redundancy
episodes of the same env seed; the first group_size to finish form the group, the others are
cancelled and their in-flight engine requests aborted.

Token bookkeeping (token in, token out):

    prompt_ids   = chat_template([system?, user: obs0], add_generation_prompt)
    response_ids = a0 [eos] o1 a1 [eos] o2 a2 ...        response_mask = 1 on a_i, 0 elsewhere
      a_i   the model's tokens exactly as generated (never re-tokenised), behavior logprob each
      eos   added (mask 0) only when a turn ended without the end token (length limit)
      o_i   the template's text for the next user message + generation prompt, tokenised alone: the
            string difference render(history + user o_i, gen) − render(history) (a prefix check
            guards templates that would break it)
The reward is the episode return (sum of step rewards). Each model token carries the policy version
of the turn that produced it.

Defined rules for bad input (counted in AgenticStats, the run goes on):
    unparseable action / bad tool arguments   the env's rule (penalty, continue or end): info flags
    env raises or exceeds reset/step timeout  the episode fails; the group forms from the others or
                                              is dropped when fewer than group_size finish
    observation beyond max_episode_tokens     the episode ends there (truncated), observation dropped
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Optional

from megatron_flash.counters import Counters
from megatron_flash.rollout.group_runner import quiet_abort, redundant_group
from megatron_flash.trace import TRACER, tag_requests
from megatron_flash.types import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AgenticStats(Counters):
    episodes: int = 0
    episodes_failed: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    cancelled_redundant: int = 0
    truncated: int = 0
    invalid_actions: int = 0
    tool_errors: int = 0
    turns: int = 0
    successes: int = 0
    groups_dropped: int = 0

    def as_metrics(self) -> dict[str, float]:
        done = max(self.episodes, 1)
        return {"env/episodes": self.episodes, "env/success_rate": self.successes / done,
                "env/turns_mean": self.turns / done, "env/failed": self.episodes_failed,
                "env/errors": self.env_errors, "env/timeouts": self.env_timeouts,
                "env/cancelled_redundant": self.cancelled_redundant, "env/truncated": self.truncated,
                "env/invalid_actions": self.invalid_actions, "env/tool_errors": self.tool_errors,
                "env/groups_dropped": self.groups_dropped}


@dataclasses.dataclass
class SeedPrompt:
    """The agentic 'dataset item': an environment seed."""

    index: int
    seed: int
    text: str = ""
    answer: str = ""
    prompt_ids: tuple = ()
    meta: Optional[dict] = None


class SeedDataset:
    def __init__(self, *, first_seed: int = 0, num_seeds: int = 0) -> None:
        self.first_seed, self.num_seeds, self._next = first_seed, num_seeds, 0

    def next_prompt(self) -> SeedPrompt:
        i = self._next
        self._next += 1
        seed = self.first_seed + (i % self.num_seeds if self.num_seeds else i)
        return SeedPrompt(index=i, seed=seed, text=f"env seed {seed}")

    def state_dict(self) -> dict[str, int]:
        return {"position": self._next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._next = int(state["position"])


class ChatTokens:
    """Chat-template rendering and the observation-delta rule, over a HF tokenizer."""

    def __init__(self, tokenizer: Any, *, system_prompt: str = "") -> None:
        self.tok = tokenizer
        self.system_prompt = system_prompt
        self.eos_id = tokenizer.eos_token_id

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def first(self, observation: str) -> tuple[list[int], list[dict[str, str]]]:
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": observation})
        return self.encode(self._render(messages, generation_prompt=True)), messages

    def observation(self, messages: list[dict[str, str]], action_text: str,
                    observation: str) -> tuple[list[int], list[dict[str, str]]]:
        before = messages + [{"role": "assistant", "content": action_text}]
        after = before + [{"role": "user", "content": observation}]
        head = self._render(before, generation_prompt=False)
        full = self._render(after, generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template does not render a conversation as a prefix of its "
                             "continuation; multi-turn token bookkeeping needs that property")
        delta = full[len(head):]
        return self.encode(delta), after


class EnvGroupRunner:
    """Runs one group of episodes; plugged into RolloutScheduler as its group runner."""

    def __init__(self, *, agentic_cfg: Any, proxy: Any, tokenizer: Any, sampling_params: dict[str, Any],
                 max_seq_len: int, version_fn: Callable[[], int], max_resumes: int = 16) -> None:
        self.cfg = agentic_cfg
        self.proxy = proxy
        self.chat = ChatTokens(tokenizer, system_prompt=agentic_cfg.system_prompt)
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.sampling_params = dict(sampling_params)
        self.max_seq_len = max_seq_len
        self.version_fn = version_fn
        self.max_resumes = max_resumes
        self.stats = AgenticStats()
        self.rollout_stats: Any = None  # the scheduler's RolloutStats: requests and tokens are counted there too

    def _make_env(self, seed: int) -> Any:
        """A fresh env per episode (a timed-out threaded env is never reused); `seed` makes its
        injected latencies reproducible per (env seed, episode index)."""
        from megatron_flash.agentic.registry import make_env

        env = make_env(self.cfg.env, **dict(self.cfg.env_params))
        if self.cfg.latency:
            from megatron_flash.agentic.wrappers import LatencyEnv

            env = LatencyEnv.from_config(env, dict(self.cfg.latency), seed=seed)
        return env

    # ------------------------------------------------------------------ one group
    async def run_group(self, *, group_id: int, prompt: SeedPrompt, version: int, group_size: int) -> list[Sample]:
        current: dict[int, str] = {}  # episode → rid of its in-flight request (to abort when cancelled)
        tasks = [asyncio.create_task(self._episode(prompt, group_id, i, version, current))
                 for i in range(group_size + self.cfg.redundancy)]

        async def abort_in_flight(pending: list) -> None:
            if pending:
                await asyncio.gather(*[quiet_abort(self.proxy, rid) for rid in list(current.values())])
        return await redundant_group(tasks, group_id=group_id, group_size=group_size, stats=self.stats,
                                     what=f"env seed {prompt.seed}", cleanup=abort_in_flight)

    # ------------------------------------------------------------------ one episode
    async def _episode(self, prompt: SeedPrompt, group_id: int, index: int, version: int,
                       current: dict[int, str]) -> Sample:
        cfg = self.cfg
        env = self._make_env(prompt.seed * 1009 + index)
        try:
            try:
                with TRACER.concurrent("env reset", "env", "envs", seed=prompt.seed, group=group_id, episode=index):
                    obs = await asyncio.wait_for(env.reset(prompt.seed), timeout=cfg.reset_timeout_s)
                return await self._turns(env, obs, prompt, group_id, index, version, current)
            except asyncio.TimeoutError as e:
                self.stats.env_timeouts += 1
                self.stats.episodes_failed += 1
                raise RuntimeError(f"env {cfg.env} seed {prompt.seed}: timed out") from e
            except asyncio.CancelledError:
                raise
            except Exception as e:
                from megatron_flash.engines.client import EngineError

                self.stats.episodes_failed += 1
                if not isinstance(e, (EngineError, _EnvFailed)):
                    self.stats.env_errors += 1  # the env (or the user's env code) raised
                raise
        finally:
            current.pop(index, None)
            try:
                await env.close()
            except Exception as e:  # closing a broken env must not hide the episode's outcome
                logger.debug("env close failed: %s", e)

    async def _turns(self, env: Any, obs: str, prompt: SeedPrompt, group_id: int, index: int, version: int,
                     current: dict[int, str]) -> Sample:
        cfg = self.cfg
        prompt_ids, messages = self.chat.first(obs)
        budget_total = min(cfg.max_episode_tokens, self.max_seq_len - len(prompt_ids) - 1)
        if budget_total <= 0:
            self.stats.truncated += 1
            raise _EnvFailed(f"env seed {prompt.seed}: the first observation ({len(prompt_ids)} tokens) leaves "
                             f"no room in trainer.max_seq_len={self.max_seq_len}")
        ids: list[int] = []
        lps: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        ret, turns, success = 0.0, 0, False
        for turn in range(cfg.max_turns):
            room = min(cfg.max_tokens_per_turn, budget_total - len(ids))
            if room <= 0:
                self.stats.truncated += 1
                break
            action_ids, action_lps, action_versions = await self._generate(
                prompt_ids + ids, room, f"g{group_id}-e{index}-t{turn}", index, current)
            ids += action_ids
            lps += action_lps
            mask += [1] * len(action_ids)
            versions += action_versions
            turns += 1
            action_text = self.decode(action_ids)
            with TRACER.concurrent("env step", "env", "envs", seed=prompt.seed, group=group_id, episode=index,
                                   turn=turn) as info:
                result = await asyncio.wait_for(env.step(action_text), timeout=cfg.step_timeout_s)
                info.update(reward=float(result.reward), done=bool(result.done))
            ret += float(result.reward)
            info = result.info or {}
            self.stats.invalid_actions += int(bool(info.get("invalid")))
            self.stats.tool_errors += int(bool(info.get("tool_error")))
            success = success or bool(info.get("success"))
            if result.done:
                break
            tail: list[int] = []
            if not action_ids or action_ids[-1] != self.chat.eos_id:
                tail = [self.chat.eos_id]  # the template closes every assistant turn with the end token
            obs_ids, messages = self.chat.observation(messages, action_text, result.observation)
            if len(ids) + len(tail) + len(obs_ids) >= budget_total:
                self.stats.truncated += 1
                break
            ids += tail + obs_ids
            lps += [0.0] * (len(tail) + len(obs_ids))
            mask += [0] * (len(tail) + len(obs_ids))
            versions += [versions[-1] if versions else version] * (len(tail) + len(obs_ids))
        self.stats.episodes += 1
        self.stats.turns += turns
        self.stats.successes += int(success or ret > 0)
        return Sample(prompt_ids=list(prompt_ids), response_ids=ids, behavior_logprobs=lps, reward=ret,
                      group_id=group_id, finished=True, version_start=version,
                      version_end=max(versions) if versions else version,
                      token_versions=versions if len(set(versions)) > 1 else None, prompt_index=prompt.index,
                      finish_reason="stop", response_mask=mask)

    async def _generate(self, input_ids: list[int], max_new_tokens: int, rid: str, index: int,
                        current: dict[int, str]) -> tuple[list[int], list[float], list[int]]:
        """One model turn; resumed from its prefix when a weight push aborts it (pause mode abort)."""
        out_ids: list[int] = []
        out_lps: list[float] = []
        out_versions: list[int] = []
        for attempt in range(self.max_resumes + 1):
            seg_version = self.version_fn()
            seg_rid = f"{rid}-r{attempt}"
            current[index] = seg_rid
            params = {**self.sampling_params, "max_new_tokens": max_new_tokens - len(out_ids)}
            tag_requests(episode=rid, version_start=seg_version, resume=attempt)
            res = await self.proxy.generate(input_ids + out_ids, params, rid=seg_rid)
            if self.rollout_stats is not None:
                self.rollout_stats.requests += 1
                self.rollout_stats.tokens_generated += len(res.output_ids)
                self.rollout_stats.resumes += int(attempt > 0)
            out_ids += list(res.output_ids)
            out_lps += list(res.output_logprobs or [])
            out_versions += [seg_version] * len(res.output_ids)
            if not res.aborted or len(out_ids) >= max_new_tokens:
                return out_ids, out_lps, out_versions
        raise RuntimeError(f"request {rid} was aborted {self.max_resumes + 1} times without finishing")


class _EnvFailed(RuntimeError):
    pass
