"""How another package runs a whole group for the scheduler (agentic episodes plug in here).

The scheduler runs a group itself (n single-turn samples) unless the runtime was given a group-runner
factory; then each group goes to `run_group`, which returns the group's finished, rewarded samples or
raises `GroupDropped` when the group cannot be completed (counted by the runner, never retried). The
factory is called on the rollout thread once the proxy exists, with the proxy and a function giving
the current policy version; the controller builds it, so rollout/ never imports its implementers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Protocol

from megatron_flash.types import Sample


logger = logging.getLogger(__name__)


async def first_successes(tasks: list[Any], count: int, *, what: str) -> list[Any]:
    """Results of the first `count` of `tasks` to succeed, in finishing order (fewer when not enough
    succeed). A failed task is the task's own business (counted where it failed; logged here at
    debug). Tasks still running are left to the caller, which cancels and cleans them up."""
    done: list[Any] = []
    for next_done in asyncio.as_completed(tasks):
        try:
            done.append(await next_done)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.debug("%s: a task failed: %s", what, error)
        if len(done) == count:
            break
    return done


class GroupDropped(RuntimeError):
    """Fewer than group_size samples of a group could finish (e.g. env failures): drop it, don't retry."""


async def redundant_group(tasks: list[Any], *, group_id: int, group_size: int, stats: Any, what: str,
                          cleanup: Callable[[list[Any]], Awaitable[None]]) -> list[Sample]:
    """A group from group_size + redundancy episode `tasks`: the first group_size to finish, stamped with
    `group_id`. The rest are cancelled (counted in `stats.cancelled_redundant`) after `cleanup(pending)`
    has run (abort their requests, close their sessions); fewer than group_size finished →
    `stats.groups_dropped` + 1 and GroupDropped naming `what` (the group's env seed or task)."""
    finished: list[Sample] = []
    try:
        finished = await first_successes(tasks, group_size, what=f"group {group_id}")
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        stats.cancelled_redundant += len(pending)
        await cleanup(pending)
        await asyncio.gather(*pending, return_exceptions=True)
    if len(finished) < group_size:
        stats.groups_dropped += 1
        raise GroupDropped(f"group {group_id} ({what}): only {len(finished)} of {len(tasks)} episodes finished, "
                           f"{group_size} needed")
    for s in finished:
        s.group_id = group_id
    return finished


async def quiet_abort(proxy: Any, rid: str) -> None:
    """Abort request `rid` through the proxy; one that just finished is no error."""
    try:
        await proxy.abort(rid)
    except Exception as error:
        logger.debug("abort %s: %s", rid, error)


class GroupRunner(Protocol):
    stats: Any
    """A counter object with `take()` → an object with `as_metrics()`: merged into the step's metrics."""
    rollout_stats: Any
    """Set by the runtime: the scheduler's counters, for the runner to report its requests in."""

    async def run_group(self, *, group_id: int, prompt: Any, version: int, group_size: int) -> list[Sample]:
        ...


GroupRunnerFactory = Callable[[Any, Callable[[], int]], GroupRunner]
"""(proxy, current policy version) → the runner."""
