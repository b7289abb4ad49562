"""How the trainer ranks talk to the engines during a sync: concurrent HTTP calls from one rank
(through `EngineClient`, errors collected per engine), and the small collectives that let every
rank learn rank 0's answers and merge everyone's errors."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

Errors = dict[str, str]
"""engine url → what went wrong, prefixed with the step."""


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (collective)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def merge_errors(errors: Errors) -> Errors:
    """Every rank's errors, the first message per engine kept (collective)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, errors)
    merged: Errors = {}
    for part in parts:
        for url, message in part.items():
            merged.setdefault(url, message)
    return merged


def sum_over_ranks(*values: int) -> list[int]:
    """Integer sums over every rank (collective)."""
    # NCCL (the default group on GPU trainers) reduces CUDA tensors only.
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    totals = torch.tensor(list(values), dtype=torch.long, device=device)
    dist.all_reduce(totals)
    return [int(v) for v in totals.tolist()]


class EngineCalls:
    """`fan(step, urls, call)` runs `call(client)` on every url concurrently from this rank."""

    def __init__(self, *, api_key: Optional[str], timeout_s: float, alive_timeout_s: float) -> None:
        self.api_key, self.timeout_s, self.alive_timeout_s = api_key, timeout_s, alive_timeout_s

    def fan(self, step: str, urls: Sequence[str], call: Callable[[Any], Any], *, session: bool = False,
            timeout_s: Optional[float] = None, retries: int = 3) -> tuple[dict[str, Any], Errors]:
        """→ (results by url, errors as 'step: message')."""
        from megatron_flash.engines.client import EngineClient

        timeout = timeout_s or self.timeout_s

        async def one(url: str) -> Any:
            # Begin/end are explicit calls here ("always"); updates are never wrapped again ("never").
            async with EngineClient(url, api_key=self.api_key, request_timeout_s=timeout, control_timeout_s=timeout,
                                    max_retries=retries, weight_update_session="always" if session else "never") as c:
                return await call(c)

        async def every() -> list[Any]:
            return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

        results: dict[str, Any] = {}
        errors: Errors = {}
        for url, out in zip(urls, asyncio.run(every()) if urls else []):
            if isinstance(out, BaseException):
                errors[url] = f"{step}: {type(out).__name__}: {out}"
            else:
                results[url] = out
        return results, errors

    def alive(self, urls: Sequence[str], *, rank0: bool) -> list[str]:
        """Engines that still answer (rank 0 asks, every rank learns; collective). /health is not
        used: SGLang answers 503 there after ~20 s paused, and a dirty engine is paused."""
        alive: list[str] = []
        if rank0:
            results, _ = self.fan("alive", urls, lambda c: c.get_weight_version(), timeout_s=self.alive_timeout_s,
                                  retries=0)
            alive = [u for u in urls if u in results]
        return from_rank0(alive)
