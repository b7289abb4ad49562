"""Agentic rollout: the environment protocol, environments by name, latency/failure injection.

Never imports Megatron or torch. Built-in environments (frozenlake, sokoban, calculator) live in
``agentic/envs`` and are imported on the first registry lookup; see ``docs/agentic.md``.
"""

from megatron_flash.agentic.protocol import (
    Env,
    EnvError,
    StepResult,
    SyncEnv,
    ThreadedEnv,
    env_thread_pool,
    set_env_thread_pool_size,
    unwrap,
)
from megatron_flash.agentic.registry import get_env_factory, list_envs, make_env, register_env
from megatron_flash.agentic.wrappers import Latency, LatencyEnv, from_config

__all__ = [
    "Env", "EnvError", "Latency", "LatencyEnv", "StepResult", "SyncEnv", "ThreadedEnv",
    "env_thread_pool", "from_config", "get_env_factory", "list_envs", "make_env", "register_env",
    "set_env_thread_pool_size", "unwrap",
]
