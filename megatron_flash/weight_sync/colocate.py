"""Colocated engines (`engines.colocate`): they share the trainer's devices, so before the trainer
computes they pause (abort) and give back their memory (weights, KV cache, CUDA graphs); the next
sync takes the weights' memory back before its values arrive and the KV cache after them.

Rank 0 holds which tags each engine released; an engine whose release fails is the caller's to take
out of service (it would keep device memory the trainer needs)."""

from __future__ import annotations

from typing import Sequence

from megatron_flash.weight_sync.calls import EngineCalls, Errors

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryHandoff:
    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls
        self.released: dict[str, set[str]] = {}

    def release(self, urls: Sequence[str]) -> Errors:
        """Rank 0: pause every engine of `urls` and release its memory; returns url → error."""
        _, errors = self.calls.fan("pause_generation", urls, lambda c: c.pause_generation("abort"))
        ok = [u for u in urls if u not in errors]
        _, more = self.calls.fan("release_memory_occupation", ok, lambda c: c.release_memory_occupation())
        errors.update(more)
        for url in ok:
            if url not in more:
                self.released[url] = set(ALL_TAGS)
        return errors

    def resume(self, urls: Sequence[str], tags: list[str], step: str) -> Errors:
        """Rank 0: take back `tags` (those still released) on `urls`; returns url → error."""
        todo = {u: [t for t in tags if t in self.released.get(u, ())] for u in urls}
        todo = {u: t for u, t in todo.items() if t}
        results, errors = self.calls.fan(step, list(todo), lambda c: c.resume_memory_occupation(todo[c.url]))
        for url in results:
            self.released[url].difference_update(todo[url])
            if not self.released[url]:
                del self.released[url]
        return errors

    def forget(self, urls: Sequence[str]) -> None:
        """Restarted engines: a new process holds its memory."""
        for url in urls:
            self.released.pop(url, None)
