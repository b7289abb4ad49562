"""Multi-turn environments and the agent gateway (`agentic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict

from megatron_flash.config.sections.base import _Section

TOOL_PARSER_NAMES = ("hermes",)  # = agentic/gateway/tool_parsers.py TOOL_PARSERS (a unit test keeps them equal)


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
