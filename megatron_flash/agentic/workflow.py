"""Agent workflows as rollout: any agent written against the OpenAI API, trained as it is.

`agentic.workflow: module:function` names an async function

    async def run(base_url: str, api_key: str, task: dict) -> float | tuple[float, dict]

that runs one episode with any OpenAI-compatible client pointed at `base_url` and returns its reward
(optionally with an info dict; `info["success"]` is counted). `task` is the dataset item: index, text,
answer, meta, and `model`, a name to send (the gateway serves the policy under any name). The run serves the gateway (gateway/) on 127.0.0.1 in the rollout thread's event loop,
over the run's proxy (queue scheduling, retries, pause modes, versions), and gives each episode its
own base URL `http://127.0.0.1:PORT/sessions/{episode}/v1`: the gateway records exactly what the
engine consumed and sampled, and the finished episode becomes one training sample (prompt = tokens
before the first sampled one; response mask 1 on sampled tokens only).

A group is rollout.n_samples_per_prompt episodes of one task, plus agentic.redundancy extra ones; the
first group_size to finish form the group, the rest are cancelled (their engine requests aborted,
their sessions closed: later calls get 409). An episode fails — counted, never retried, the group
forms from the others or is dropped — when the workflow raises, exceeds
agentic.workflow_timeout_s, made no model call, or its record exceeds trainer.max_seq_len.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import math
import secrets
import uuid
from typing import Any, Callable, Optional

from megatron_flash.agentic.env_manager import AgenticStats
from megatron_flash.rollout.group_runner import quiet_abort, redundant_group
from megatron_flash.trace import TRACER
from megatron_flash.types import Sample

logger = logging.getLogger(__name__)


def load_workflow(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"agentic.workflow must be 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"agentic.workflow={spec!r} cannot be loaded: {error}") from None
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"agentic.workflow={spec!r} must be an async function (base_url, api_key, task)")
    return fn


@dataclasses.dataclass
class WorkflowStats(AgenticStats):
    workflow_errors: int = 0
    no_model_calls: int = 0
    too_long: int = 0
    retokenize_mismatches: int = 0
    history_rewrites: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {**super().as_metrics(), "env/workflow_errors": self.workflow_errors,
                "env/no_model_calls": self.no_model_calls, "env/too_long": self.too_long,
                "gateway_retokenize_mismatch": self.retokenize_mismatches,
                "gateway_history_rewrites": self.history_rewrites}


class WorkflowGroupRunner:
    def __init__(self, *, agentic_cfg: Any, proxy: Any, tokenizer: Any, model_name: str, sampling_params: dict,
                 max_seq_len: int, version_fn: Callable[[], int], api_key: Optional[str] = None) -> None:
        from megatron_flash.agentic.gateway.core import GatewayCore

        self.cfg, self.proxy, self.max_seq_len, self.version_fn = agentic_cfg, proxy, max_seq_len, version_fn
        self.workflow = load_workflow(agentic_cfg.workflow)
        self.api_key = api_key or secrets.token_hex(16)
        self.core = GatewayCore(backend=_Backend(proxy, sampling_params, self), tokenizer=tokenizer,
                                model_name=model_name,
                                tool_parser=agentic_cfg.gateway_tool_parser,
                                default_max_tokens=agentic_cfg.max_tokens_per_turn, any_model=True)
        self.core.closed_sessions = set()
        for name in ("httpx", "httpx2"):  # agents' HTTP clients log every request at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        self.stats = WorkflowStats()
        self.rollout_stats: Any = None
        self.port: Optional[int] = None
        self._server: Any = None

    async def _ensure_server(self) -> None:
        if self._server is not None:
            return
        import uvicorn

        from megatron_flash.agentic.gateway.server import build_app
        from megatron_flash.ports import free_ports

        self.port = self.cfg.gateway_port or free_ports(1)
        config = uvicorn.Config(build_app(self.core, api_key=self.api_key), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if task.done():  # e.g. the port is taken
                task.result()
                raise RuntimeError(f"the agent gateway did not start on 127.0.0.1:{self.port}")
            await asyncio.sleep(0.01)
        logger.info("agent gateway on http://127.0.0.1:%d (workflow %s)", self.port, self.cfg.workflow)

    def base_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session}/v1"

    # ------------------------------------------------------------------ one group
    async def run_group(self, *, group_id: int, prompt: Any, version: int, group_size: int) -> list[Sample]:
        await self._ensure_server()
        task = {"model": self.core.model_name, "index": getattr(prompt, "index", -1), "text": getattr(prompt, "text", ""),
                "answer": getattr(prompt, "answer", ""), "meta": dict(getattr(prompt, "meta", None) or {})}
        sessions = [f"g{group_id}-e{i}-{uuid.uuid4().hex[:6]}" for i in range(group_size + self.cfg.redundancy)]
        tasks = [asyncio.ensure_future(self._episode(s, task, group_id, version)) for s in sessions]

        async def close_sessions(pending: list) -> None:
            for s in sessions:  # every session of the group: a straggler's late call gets 409
                self._close(s)
        return await redundant_group(tasks, group_id=group_id, group_size=group_size, stats=self.stats,
                                     what=f"task {task['index']}", cleanup=close_sessions)

    def _close(self, session_id: str) -> None:
        self.core.closed_sessions.add(session_id)
        session = self.core.sessions.pop(session_id)
        if session is not None and session.current_rid is not None:
            asyncio.ensure_future(quiet_abort(self.proxy, session.current_rid))

    # ------------------------------------------------------------------ one episode
    async def _episode(self, session_id: str, task: dict, group_id: int, version: int) -> Sample:
        try:
            with TRACER.concurrent("episode", "env", "episodes", session=session_id, prompt=task["index"]):
                out = await asyncio.wait_for(self.workflow(self.base_url(session_id), self.api_key, dict(task)),
                                             timeout=self.cfg.workflow_timeout_s)
        except asyncio.TimeoutError:
            self.stats.env_timeouts += 1
            self.stats.episodes_failed += 1
            raise RuntimeError(f"episode {session_id}: the workflow exceeded agentic.workflow_timeout_s="
                               f"{self.cfg.workflow_timeout_s:g}") from None
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.workflow_errors += 1
            self.stats.episodes_failed += 1
            raise
        reward, info = (out if isinstance(out, tuple) else (out, {}))
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            self.stats.workflow_errors += 1
            self.stats.episodes_failed += 1
            raise RuntimeError(f"episode {session_id}: the workflow returned {out!r}, not a finite reward")
        session = self.core.sessions.get(session_id)
        fields = session.sample_fields() if session is not None else None
        if fields is None:
            self.stats.no_model_calls += 1
            self.stats.episodes_failed += 1
            raise RuntimeError(f"episode {session_id}: the workflow made no model call through its base_url")
        if len(fields["prompt_ids"]) + len(fields["response_ids"]) > self.max_seq_len:
            self.stats.too_long += 1
            self.stats.episodes_failed += 1
            raise RuntimeError(f"episode {session_id}: {len(fields['prompt_ids']) + len(fields['response_ids'])} "
                               f"tokens, more than trainer.max_seq_len={self.max_seq_len}")
        self.stats.episodes += 1
        self.stats.turns += len(session.turns)
        self.stats.successes += int(bool((info or {}).get("success", reward > 0)))
        self.stats.retokenize_mismatches += session.retokenize_mismatches
        self.stats.history_rewrites += session.history_rewrites
        known = [v for v in fields["token_versions"] if v is not None]
        sampled = [v for v, m in zip(fields["token_versions"], fields["response_mask"]) if m and v is not None]
        versions = [v if v is not None else version for v in fields.pop("token_versions")]
        return Sample(**fields, reward=float(reward), group_id=group_id, finished=True, version_start=version,
                      version_end=max(known) if known else version,
                      token_versions=versions if len(set(sampled)) > 1 else None, prompt_index=task["index"],
                      finish_reason="stop")


class _Backend:
    """The proxy as the gateway's backend: the run's sampling defaults under each request's own fields.
    Every reply is counted in the runner's `rollout_stats` (requests, tokens_generated) as it arrives,
    like a single-turn request, not when its episode ends: an episode may span metrics windows, and
    tokens_per_s would read 0 in a window where engines generated but no episode finished."""

    def __init__(self, proxy: Any, defaults: dict, runner: Any) -> None:
        self.proxy, self.defaults = proxy, {k: v for k, v in defaults.items() if v is not None}
        self.runner = runner

    async def generate(self, input_ids: list[int], params: dict, *, rid: str) -> Any:
        result = await self.proxy.generate(input_ids, {**self.defaults, **params}, rid=rid)
        stats = self.runner.rollout_stats
        if stats is not None:
            stats.requests += 1
            stats.tokens_generated += len(result.output_ids)
        return result
