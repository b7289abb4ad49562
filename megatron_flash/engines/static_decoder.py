"""The local engine's static decoder: a slot KV cache, one decode step for every running request, the
step captured in CUDA graphs on a GPU, SGLang sampling inside it, one host read per step.

    engine.admit ─► add(cb_id, req, ids) ─► waiting ─┐ decoder thread, one pass:
                                                      ├─ free the slots of requests that left (finished, cancelled)
                                                      ├─ prefill: waiting requests into free slots, packed in one
                                                      │  forward (identical prompts prefilled once, KV copied),
                                                      │  first token sampled
                                                      └─ decode: rows 0..B-1 (B a bucket above the highest busy
                                                         slot), one token each; a CUDA graph per (B, length
                                                         bucket, truncation) on a GPU, the same function eagerly
                                                         on the CPU; tokens + logprobs read once → engine._record

Why this and not transformers' continuous batching (kept as `decoder=cb`): CB with SDPA needs a mask,
which turns off its CUDA graphs and fast decode path; its step cost 39 ms at one sequence on an H200
(docs/benchmarks.md), so the decoder was never flat and queue scheduling could not gain. Here a step is
the model's kernels and the sampler, replayed; its inputs (token, position, sampling parameters) live
in static per-slot tensors that the step itself advances, so a step copies nothing to the device.

The model is transformers' class with `slot_cache.slot_attention` installed. Memory: num_slots ×
slot_len tokens of K/V, allocated at start (and again on resume after release_memory_occupation).
MoE routing (data-dependent shapes, forward hooks for routed experts) runs eagerly: no graphs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Iterator

import torch

from megatron_flash.engines.device_sampling import ban_tokens, sample_device, seed_uniform
from megatron_flash.engines.slot_cache import SlotForward, SlotKVCache, install

logger = logging.getLogger(__name__)

MAX_BANNED = 16  # stop ids masked per request while min_new_tokens is not reached
MIN_LENGTH_BUCKET = 64


def bucket(value: int, limit: int, smallest: int = 1) -> int:
    """The power of two ≥ value (at least `smallest`), capped at `limit`."""
    size = smallest
    while size < value:
        size *= 2
    return min(size, limit)


class SlotState:
    """Per-slot device tensors the decode step reads and advances (the graph's static inputs)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.ids = zeros(num_slots, 1)  # the token each slot feeds next
        self.pos = zeros(num_slots)  # its position (= tokens in the slot's KV before it)
        self.out_len = zeros(num_slots)  # output tokens so far (the hash step of the next draw)
        self.active = zeros(num_slots, dtype=torch.bool)
        self.temperature = torch.ones(num_slots, device=device)
        self.greedy = zeros(num_slots, dtype=torch.bool)
        self.top_k = zeros(num_slots)
        self.top_p = torch.ones(num_slots, device=device)
        self.min_p = zeros(num_slots, dtype=torch.float32)
        self.seed = zeros(num_slots)
        self.min_new = zeros(num_slots)
        self.ban_ids = zeros(num_slots, MAX_BANNED)
        self.ban_valid = zeros(num_slots, MAX_BANNED, dtype=torch.bool)
        self.out = zeros(num_slots, 2, dtype=torch.float64)  # (token, logprob) of the last step


class StaticDecoder:
    """The decoder the engine drives; `engine` owns the requests (`_by_cb_id` under `_lock`) and
    `_record(cb_ids, tokens, logprobs)`, which appends tokens and decides finishes."""

    def __init__(self, engine: Any, *, num_slots: int, slot_len: int, seed: int | None,
                 max_prefill_tokens: int, use_graphs: bool) -> None:
        self.engine, self.model = engine, engine.model
        self.device = engine.device
        install(self.model)
        self.cache = SlotKVCache(config=engine.hf_config, num_slots=num_slots, slot_len=slot_len,
                                 device=self.device, dtype=engine.dtype)
        self.state = SlotState(num_slots, self.device)
        self.num_slots, self.slot_len, self.max_prefill_tokens = num_slots, slot_len, max_prefill_tokens
        self.positions = torch.arange(slot_len, device=self.device)
        self.vocab = engine.vocab_size
        self.use_graphs = use_graphs and self.device.type == "cuda" and not engine.route_recorder.is_moe
        self._graphs: dict[tuple[int, int, bool, bool], Any] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._seeds = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        # host mirrors, touched only by the decoder thread
        self._slot_cb: list[str | None] = [None] * num_slots
        self._slot_req: list[Any] = [None] * num_slots
        self._slot_pos = [0] * num_slots
        self._slot_truncates = [False] * num_slots
        self._slot_bans = [0] * num_slots  # steps left in which the slot masks its stop ids
        self._waiting: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._pause_count = 0
        self._parked = False
        self._stopping = False
        self._timing = [0, 0.0, 0.0, 0]
        self._pass_started = 0.0
        self._thread = threading.Thread(target=self._run, name="static-decoder", daemon=True)

    # ------------------------------------------------------------------ protocol used by the engine
    def start(self) -> None:
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, **_: Any) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._graphs.clear()

    def add(self, cb_id: str, req: Any, token_ids: list[int]) -> bool:
        with self._cond:
            if self._stopping:
                return False
            self._waiting.append((cb_id, req, token_ids))
            self._cond.notify_all()
        return True

    def cancel(self, cb_id: str) -> None:
        """The engine already forgot `cb_id`; the next pass frees its slot (or drops it from waiting)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Park the decoder between passes for the duration (any thread; nestable)."""
        with self._cond:
            self._pause_count += 1
            self._cond.notify_all()
            while not self._parked and self._thread.is_alive():
                self._cond.wait(0.05)
        try:
            yield
        finally:
            with self._cond:
                self._pause_count -= 1
                self._cond.notify_all()

    def reset_graphs(self) -> None:
        """Parameters got new storage (weights resumed): captured graphs point at the old one."""
        self._graphs.clear()

    # ------------------------------------------------------------------ decoder thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and (self._pause_count or not self._has_work()):
                    if self._pause_count and not self._parked:
                        self._parked = True
                        self._cond.notify_all()
                    self._cond.wait(0.05 if self._pause_count else 0.5)
                self._parked = False
                if self._stopping:
                    return
            started = self._pass_started = time.perf_counter()
            self._timing = [0, 0.0, 0.0, 0]  # this pass's steps, step seconds, sampler seconds, graphed steps
            try:
                self._free_left()
                self._prefill(self._take_waiting())
                if any(self._slot_cb):
                    self._decode()
            except Exception as error:  # every request in the decoder fails; the engine keeps serving
                logger.exception("static decoder pass failed")
                self._fail_all(error)
                continue
            steps, step_s, sampler_s, graphed = self._timing
            if steps:
                self.engine.step_profile.add_pass(steps=steps, step_s=step_s, sampler_s=sampler_s,
                                                  loop_s=time.perf_counter() - started, graphed=graphed)

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(cb is not None for cb in self._slot_cb)

    def _owner(self, cb_id: str | None) -> Any:
        return None if cb_id is None else self.engine._by_cb_id.get(cb_id)

    def _free_left(self) -> None:
        """Slots whose request left (finished, cancelled, retracted) become free."""
        with self.engine._lock:
            gone = [s for s, cb in enumerate(self._slot_cb) if cb is not None and self._owner(cb) is None]
        if gone:
            for slot in gone:
                self._slot_cb[slot] = self._slot_req[slot] = None
            self.state.active[torch.tensor(gone, device=self.device)] = False

    def _take_waiting(self) -> list[tuple[str, Any, list[int], int]]:
        free = [s for s, cb in enumerate(self._slot_cb) if cb is None]
        taken, tokens = [], 0
        with self._cond:
            while self._waiting and free:
                cb_id, req, ids = self._waiting[0]
                with self.engine._lock:
                    gone = self._owner(cb_id) is None
                if gone:  # cancelled while waiting
                    self._waiting.popleft()
                    continue
                if taken and tokens + len(ids) > self.max_prefill_tokens:
                    break
                self._waiting.popleft()
                taken.append((cb_id, req, ids, free.pop(0)))
                tokens += len(ids)
        return taken

    def _fail_all(self, error: Exception) -> None:
        victims = [(cb, r) for cb, r in zip(self._slot_cb, self._slot_req) if cb is not None]
        with self._cond:
            victims += [(cb, r) for cb, r, _ in self._waiting]
            self._waiting.clear()
        self._slot_cb = [None] * self.num_slots
        self._slot_req = [None] * self.num_slots
        self.state.active.zero_()
        for _, req in victims:
            self.engine._fail(req, error)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, batch: list[tuple[str, Any, list[int], int]]) -> None:
        if not batch:
            return
        started = time.perf_counter()
        first: dict[tuple[int, ...], int] = {}  # prompt → index of the sequence that prefills it
        seqs, owners, packed, keep, source = [], [], [], [], []
        for cb_id, req, ids, slot in batch:
            key = tuple(ids)
            if key in first and req.routes is None:  # a shared prompt: prefill once, copy its KV
                source.append(first[key])
                continue
            first.setdefault(key, len(seqs))
            source.append(len(seqs))
            seqs.append((slot, len(packed), len(ids)))
            owners.append(cb_id)
            packed.extend(ids)
            keep.append(len(packed) - 1)
        if self.engine.route_recorder.is_moe:
            self.engine.route_recorder.note_layout([(cb, 0, n) for cb, (_, _, n) in zip(owners, seqs)])
        positions = torch.cat([torch.arange(n) for _, _, n in seqs]).to(self.device)
        fwd = SlotForward(cache=self.cache, decode=False, seqs=tuple(seqs))
        logits = self.model(input_ids=torch.tensor([packed], device=self.device), position_ids=positions[None],
                            attention_mask=self._no_mask, use_cache=False, slot_forward=fwd,
                            logits_to_keep=torch.tensor(keep, device=self.device)).logits[0]
        for (_, _, ids, slot), s in zip(batch, source):
            if seqs[s][0] != slot:
                self.cache.copy_slot(seqs[s][0], slot, len(ids))
        slots = [slot for *_, slot in batch]
        self._load_params(batch)
        rows = torch.tensor(slots, device=self.device)
        logits = logits[torch.tensor(source, device=self.device)]
        sampling = time.perf_counter()
        tokens, logprobs = self._sample(logits, rows, any(self._slot_truncates[s] for s in slots),
                                        any(self._slot_bans[s] > 0 for s in slots))
        out = torch.stack([tokens.double(), logprobs.double()], 1).tolist()
        self._timing[0] += 1
        self._timing[1] += time.perf_counter() - started
        self._timing[2] += time.perf_counter() - sampling
        self._record([cb for cb, *_ in batch], out)
        lengths = torch.tensor([len(ids) for _, _, ids, _ in batch], device=self.device)
        state = self.state
        state.ids[rows, 0] = tokens
        state.pos[rows] = lengths
        state.out_len[rows] += 1
        state.active[rows] = True
        for (cb_id, req, ids, slot) in batch:
            self._slot_cb[slot], self._slot_req[slot], self._slot_pos[slot] = cb_id, req, len(ids)

    @property
    def _no_mask(self) -> torch.Tensor:
        # a 4-D tensor makes transformers pass the mask through untouched; prefill attends causally
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    def _load_params(self, batch: list[tuple[str, Any, list[int], int]]) -> None:
        """Write the sampling parameters of newly admitted requests into their slots (one copy per field)."""
        rows, temperature, greedy, top_k, top_p, min_p, seeds, min_new, out_len = ([] for _ in range(9))
        bans, valid = [], []
        for _, req, _, slot in batch:
            spec = req.spec
            rows.append(slot)
            greedy.append(spec.greedy)
            temperature.append(1.0 if spec.greedy else spec.temperature)
            top_k.append(min(spec.top_k, self.vocab))
            top_p.append(spec.top_p)
            min_p.append(spec.min_p)
            seeds.append(spec.sampling_seed if spec.sampling_seed is not None
                         else int(torch.randint(0, 1 << 62, (1,), generator=self._seeds)))
            min_new.append(spec.min_new_tokens)
            out_len.append(len(req.output_ids))
            stop = sorted(req.stop_ids)[:MAX_BANNED] if spec.min_new_tokens else []
            bans.append((stop or [0]) + [stop[0] if stop else 0] * (MAX_BANNED - max(len(stop), 1)))
            valid.append([bool(stop)] * MAX_BANNED if stop else [False] * MAX_BANNED)
            self._slot_bans[slot] = spec.min_new_tokens - len(req.output_ids) if stop else 0
            self._slot_truncates[slot] = (not spec.greedy and (spec.top_k < self.vocab or spec.top_p < 1.0
                                                                or spec.min_p > 0.0))
            if len(req.stop_ids) > MAX_BANNED and spec.min_new_tokens:
                logger.warning("request %s: only %d of its %d stop ids are masked before min_new_tokens",
                               req.rid, MAX_BANNED, len(req.stop_ids))
        s, dev = self.state, self.device
        index = torch.tensor(rows, device=dev)
        s.temperature[index] = torch.tensor(temperature, device=dev)
        s.greedy[index] = torch.tensor(greedy, device=dev)
        s.top_k[index] = torch.tensor(top_k, device=dev)
        s.top_p[index] = torch.tensor(top_p, device=dev)
        s.min_p[index] = torch.tensor(min_p, device=dev)
        s.seed[index] = torch.tensor(seeds, device=dev)
        s.min_new[index] = torch.tensor(min_new, device=dev)
        s.out_len[index] = torch.tensor(out_len, device=dev)
        s.ban_ids[index] = torch.tensor(bans, device=dev)
        s.ban_valid[index] = torch.tensor(valid, device=dev)

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor | slice, truncate: bool,
                bans: bool) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.state
        logits = logits.float()
        if bans:  # some row still masks its stop ids (min_new_tokens)
            banned = s.ban_valid[rows] & (s.out_len[rows] < s.min_new[rows]).view(-1, 1)
            logits = ban_tokens(logits, s.ban_ids[rows], banned)
        uniform = seed_uniform(s.seed[rows], s.out_len[rows])
        return sample_device(logits, temperature=s.temperature[rows], greedy=s.greedy[rows], top_k=s.top_k[rows],
                             top_p=s.top_p[rows], min_p=s.min_p[rows], uniform=uniform, truncate=truncate)

    # ------------------------------------------------------------------ decode
    def _decode(self) -> None:
        busy = [s for s, cb in enumerate(self._slot_cb) if cb is not None]
        rows = bucket(busy[-1] + 1, self.num_slots)
        length = bucket(max(self._slot_pos[s] for s in busy) + 1, self.slot_len, MIN_LENGTH_BUCKET)
        truncate = any(self._slot_truncates[s] for s in busy)
        bans = any(self._slot_bans[s] > 0 for s in busy)
        recorder = self.engine.route_recorder
        if recorder.is_moe:
            recorder.note_layout([(self._slot_cb[r] or "", self._slot_pos[r], 1) for r in range(rows)])
        started = time.perf_counter()
        graph = self._graph(rows, length, truncate, bans) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._step(rows, length, truncate, bans)
        out = self.state.out[:rows].tolist()  # the one host read of the step
        # --decode-step-ms: the pass (a prefill before this decode included: one step) delivers its tokens
        # at least T after it began; sleeps holding no lock (step_profile.StepFloor)
        self.engine.step_floor.pad(self._pass_started)
        self._timing[0] += 1
        self._timing[1] += time.perf_counter() - started
        self._timing[3] += graph is not None
        self._record([self._slot_cb[r] for r in range(rows)], out)
        for s in busy:
            self._slot_pos[s] += 1
            self._slot_bans[s] -= 1

    def _step(self, rows: int, length: int, truncate: bool, bans: bool) -> None:
        """One decode step of rows 0..rows-1 over `length` positions, entirely on the device."""
        s = self.state
        mask = (self.positions[:length].view(1, length) <= s.pos[:rows].view(rows, 1)).view(rows, 1, 1, length)
        write = s.pos[:rows].clamp(max=self.slot_len - 1)  # idle rows of the bucket write in bounds
        fwd = SlotForward(cache=self.cache, decode=True, rows=rows, length=length, write=write, mask=mask)
        logits = self.model(input_ids=s.ids[:rows], position_ids=s.pos[:rows].view(rows, 1), attention_mask=mask,
                            use_cache=False, slot_forward=fwd).logits[:, -1]
        sampling = time.perf_counter()  # host time: meaningful when eager on the CPU (a graph replays it all)
        tokens, logprobs = self._sample(logits, slice(0, rows), truncate, bans)
        self._timing[2] += time.perf_counter() - sampling
        s.out[:rows, 0] = tokens.double()
        s.out[:rows, 1] = logprobs.double()
        active = s.active[:rows]
        s.ids[:rows, 0] = torch.where(active, tokens, s.ids[:rows, 0])
        s.pos[:rows] += active.long()
        s.out_len[:rows] += active.long()

    def _graph(self, rows: int, length: int, truncate: bool, bans: bool) -> Any:
        key = (rows, length, truncate, bans)
        graph = self._graphs.get(key)
        if graph is not None or not self.use_graphs:
            return graph
        saved = self.state.active.clone()
        self.state.active.zero_()  # warm-up and capture run the step: with no row active it advances nothing
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(*key)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine's other threads (weight loads, teacher-forced scoring) may use the GPU
            # while this thread captures
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step(*key)
            self._graphs[key] = graph
        except Exception:
            logger.exception("CUDA graph capture failed for %s: decoding eagerly from now on", key)
            self.use_graphs, graph = False, None
        finally:
            self.state.active.copy_(saved)
        return graph

    def _record(self, cb_ids: list[str | None], out: list[list[float]]) -> None:
        live = [(cb, int(token), logprob) for cb, (token, logprob) in zip(cb_ids, out) if cb is not None]
        self.engine._record([c for c, _, _ in live], [t for _, t, _ in live], [lp for _, _, lp in live])
