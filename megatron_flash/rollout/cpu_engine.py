"""Generation engine of the CPU engine server: transformers continuous batching (CB) with SGLang sampling.

The HTTP layer (`cpu_server.py`) is thin; every behaviour of the SGLang contract lives here.

    HTTP coroutine ──admit (waits while paused / updating)──► _Request ──add_request──► CB manager thread
         ▲                                                                               │ paged KV, scheduling,
         └──── done event ◄── finish detected by _SGLangSampler, inside the CB step ◄────┘ prefill chunking

Why a sampler inside CB: CB's own sampling reports logprobs of the *processed* logits and decides greedy
vs sampling for the whole manager. SGLang reports log_softmax(logits / T) before top-k/top-p/min-p
(T = 1 for greedy) and mixes greedy and sampled requests in one batch. So the engine installs one CB
logits processor (`_SGLangSampler`) that sees the raw fp32 logits of every row that gets a new token,
picks the token itself with SGLang's semantics, records (token, raw logprob) on the request, and returns
a one-hot score row so CB's multinomial takes exactly that token. CB keeps everything else: the paged
cache, continuous batching, split prefill, cancellation, and `pause()` for in-place weight writes.
Our records are the source of truth for outputs, which also fixes "cancel yields no final output".

Pause modes (SGLang names; what this engine does):
- abort: every admitted request ends now with finish_reason abort and its partial output.
- in_place: the CB loop is parked inside `pause()`; requests keep their KV and continue after
  continue_generation (tokens generated after a weight update continue on the old KV, as SGLang).
- retract: in-flight requests leave CB (KV released, as SGLang); their generated prefix is kept and on
  continue_generation they are re-prefilled as prompt+prefix with the remaining budget, so a weight
  update in between is applied to the whole prefix (SGLang recomputes the KV the same way).
While paused, new requests wait at admission until continue_generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import glob
import io
import logging
import math
import os
import pickle
import threading
import time
from typing import Any, Callable

import torch

from megatron_flash.weight_sync.process_group import new_weight_update_group  # noqa: F401 (re-export)

logger = logging.getLogger(__name__)

TOP_K_ALL = 1 << 30
_SAMPLING_EPS = 1e-6
_FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                  "queued. Retract or finish them, then call /flush_cache.")


def abort_reason(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """The subset of SGLang's `sampling_params` the CPU engine implements (same names, defaults, checks)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    # Accepted only at their neutral value: anything else changes the distribution in ways not implemented here.
    _NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
                "stop": None, "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
                "structural_tag": None, "logit_bias": None, "beam_width": None, "custom_params": None}
    _IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @classmethod
    def from_json(cls, params: dict | None, *, vocab_size: int) -> "SamplingSpec":
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
        params = dict(params or {})
        for key, neutral in cls._NEUTRAL.items():
            value = params.pop(key, None)
            if value not in (None, neutral, [], "", {}):
                raise ValueError(f"sampling_params.{key}={value!r} is not supported by the CPU engine")
        for key in cls._IGNORED:
            params.pop(key, None)
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop_token_ids",
                 "ignore_eos", "sampling_seed"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params: {unknown}")

        def get(name: str, default: Any) -> Any:
            value = params.get(name)
            return default if value is None else value

        temperature, top_k = float(get("temperature", 1.0)), int(get("top_k", -1))
        max_new_tokens, min_new_tokens = int(get("max_new_tokens", 128)), int(get("min_new_tokens", 0))
        top_p, min_p = float(get("top_p", 1.0)), float(get("min_p", 0.0))
        if not math.isfinite(temperature) or temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
        if 0 <= temperature < _SAMPLING_EPS:  # SGLang: greedy is top_k = 1 at temperature 1
            temperature, top_k = 1.0, 1
        if top_k == -1:
            top_k = TOP_K_ALL
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}.")
        stop_ids = frozenset(int(t) for t in (params.get("stop_token_ids") or []) if t is not None)
        if any(not 0 <= t < vocab_size for t in stop_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {sorted(stop_ids)}")
        seed = params.get("sampling_seed")
        return cls(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                   min_new_tokens=min_new_tokens, stop_token_ids=stop_ids, ignore_eos=bool(get("ignore_eos", False)),
                   sampling_seed=None if seed is None else int(seed))


class _Request:
    """Engine-side state of one admitted request. Token lists are appended by the CB thread under the lock."""

    def __init__(self, *, rid: str, prompt_ids: list[int], spec: SamplingSpec, stop_ids: frozenset[int],
                 loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.rid, self.prompt_ids, self.spec, self.stop_ids, self.loop = rid, prompt_ids, spec, stop_ids, loop
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict | None = None
        self.done = asyncio.Event()
        self.progress = asyncio.Event() if stream else None  # set after each token for streaming responses
        self.cb_id: str | None = None  # id of the current CB submission, None when not inside CB
        self.num_submissions = 0
        self.num_retractions = 0
        self.kv_tokens = 0  # KV reserved for this request (see CpuEngine._kv_need), 0 once released
        self.version_events: list[tuple[str, int]] = []  # (version before a change, tokens generated under it)
        self.created = time.perf_counter()
        self.generator = None
        if spec.sampling_seed is not None:
            self.generator = torch.Generator().manual_seed(spec.sampling_seed)

    def notify(self) -> None:
        """Wake the HTTP coroutine; safe from any thread."""
        def wake() -> None:
            if self.progress is not None:
                self.progress.set()
            if self.finish is not None:
                self.done.set()
        self.loop.call_soon_threadsafe(wake)


def _version_spans(events: list[tuple[str, int]], current: str, num_tokens: int) -> list[dict]:
    """SGLang's weight_versions: which policy version produced which output-token span [start, end)."""
    spans: list[list] = []
    for version, end in [*events, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    visible = [s for s in spans if s[1] < num_tokens or s[1] == 0]
    return [{"version": v, "start": s, "end": min(e, num_tokens)} for v, s, e in visible]


def _make_sampler_processor(engine: "CpuEngine") -> Any:
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    class _SGLangSampler(ContinuousBatchingLogitsProcessor):
        """One CB logits processor doing SGLang sampling; CB calls prepare_tensor_args then __call__ per step."""

        supported_kwargs: dict[str, type] = {}
        ignored_kwargs: tuple[str, ...] = ()

        def __init__(self) -> None:
            self.rows: list[str] = []

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
            self.rows = [fs.state.request_id for fs in requests_with_new_token]
            return torch.zeros(len(self.rows), dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            # CB keeps one logits row per request in the batch, but only the first len(rows) belong to
            # requests with a new token (in order); a request still in chunked prefill adds a trailing
            # row that CB never reads. Sample the real rows, leave the rest.
            n = len(self.rows)
            assert scores.size(0) >= n, (scores.shape, n)
            if scores.size(0) == n:
                return engine._sample_step(self.rows, scores)
            out = scores.clone()
            out[:n] = engine._sample_step(self.rows, scores[:n])
            return out

    return _SGLangSampler()


class _PauseHolder:
    """Holds CB's `pause()` from a dedicated thread (pause blocks, and its counter is thread-local)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._entered, self._release = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cb-pause-holder", daemon=True)

    def _run(self) -> None:
        try:
            with self._manager.pause():
                self._entered.set()
                self._release.wait()
        except BaseException as error:  # surfaced to the awaiting coroutine
            self._error = error
            self._entered.set()

    async def acquire(self) -> None:
        self._thread.start()
        await asyncio.to_thread(self._entered.wait)
        if self._error is not None:
            raise RuntimeError(f"could not pause the generation loop: {self._error}")

    def release(self) -> None:
        self._release.set()


class CpuEngine:
    """SGLang-contract generation engine on transformers continuous batching (CPU, fp32).

    All public coroutines run on one asyncio loop; the CB loop runs in its own thread.
    """

    def __init__(self, *, model_path: str, num_blocks: int = 64, page_size: int = 16, max_batch_tokens: int = 256,
                 seed: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )
        from transformers.generation.logits_process import LogitsProcessorList

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"--model-path {model_path!r} is not a Hugging Face model directory (no config.json)")
        self.model_path = model_path
        self.tokenizer_path = model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception as error:  # a checkpoint without tokenizer still serves input_ids
            logger.warning("no tokenizer at %s (%s): text fields will be null", model_path, error)
            self.tokenizer = None
        self.vocab_size = int(self.hf_config.get_text_config().vocab_size)
        eos = [self.model.generation_config.eos_token_id, self.hf_config.eos_token_id]
        self.eos_ids = frozenset(t for e in eos for t in ([e] if isinstance(e, int) else (e or [])) if t >= 0)
        max_positions = getattr(self.hf_config.get_text_config(), "max_position_embeddings", None) or 1 << 30
        self.capacity = min(num_blocks * page_size, int(max_positions))
        self.num_blocks, self.page_size, self.max_batch_tokens = num_blocks, page_size, max_batch_tokens
        self.weight_version = "default"
        self.load_format = "auto"

        self._lock = threading.Lock()  # guards _by_cb_id, the token lists of requests and _kv_reserved
        # Admission control: transformers' batcher fails requests (and may wedge) when the running requests
        # need more KV than the cache holds, so a request enters CB only once its worst case fits.
        self._kv_capacity = num_blocks * page_size
        self._kv_reserved = 0
        self._by_cb_id: dict[str, _Request] = {}
        self._live: dict[str, _Request] = {}
        self._kv_queue: dict[str, _Request] = {}  # admitted by HTTP, waiting at the gate
        self._paused = False
        self._pause_holder: _PauseHolder | None = None
        self._retracted: list[_Request] = []
        self._num_updates_waiting = 0
        self._gate: asyncio.Condition | None = None
        self._update_lock: asyncio.Lock | None = None
        self._session_open = False
        self._groups: dict[str, Any] = {}

        self._released: set[str] = set()  # memory tags given back (release_memory_occupation)
        self.num_releases = 0
        self._weight_meta: dict[str, tuple[torch.Size, torch.dtype]] = {}

        generation_config = GenerationConfig(do_sample=True, eos_token_id=sorted(self.eos_ids) or -1)
        cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens,
            allow_block_sharing=False,  # no prefix cache: KV written under old weights is never reused
            use_async_batching=False, use_cuda_graph=False, return_logprobs=False, seed=seed,
        )

        def new_manager() -> Any:  # the paged KV cache lives in the CB manager: made again on resume
            manager = self.model.init_continuous_batching(generation_config=generation_config,
                                                          continuous_batching_config=cb_config)
            processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([_make_sampler_processor(self)]))
            processors.tensors_required = 1  # one int32 row of per-request arguments (unused; rows come from prepare)
            manager.logit_processor = processors
            manager.start()
            return manager

        self._new_manager = new_manager
        self._manager = new_manager()

    # ------------------------------------------------------------------ CB thread: sampling
    @torch.no_grad()
    def _sample_step(self, cb_ids: list[str], scores: torch.Tensor) -> torch.Tensor:
        with self._lock:
            reqs = [self._by_cb_id.get(cb_id) for cb_id in cb_ids]
        scores = scores.float().clone()
        temperatures = torch.ones(len(reqs), 1)
        for i, req in enumerate(reqs):
            if req is None:
                continue
            if not req.spec.greedy:
                temperatures[i, 0] = req.spec.temperature
            if len(req.output_ids) < req.spec.min_new_tokens and req.stop_ids:
                scores[i, sorted(req.stop_ids)] = float("-inf")
        logprobs = torch.log_softmax(scores / temperatures, dim=-1)
        tokens = torch.argmax(scores, dim=-1)
        for i, req in enumerate(reqs):
            if req is None or req.spec.greedy:
                continue
            probs = logprobs[i].exp()
            spec = req.spec
            if spec.top_k < probs.numel():
                kth = torch.topk(probs, spec.top_k).values[-1]
                probs = torch.where(probs < kth, 0.0, probs)
            if spec.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                exclusive = torch.cumsum(sorted_probs, 0) - sorted_probs
                sorted_probs[exclusive > spec.top_p * sorted_probs.sum()] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            if spec.min_p > 0.0:
                probs = torch.where(probs < spec.min_p * probs.max(), 0.0, probs)
            tokens[i] = torch.multinomial(probs, 1, generator=req.generator)[0]

        touched = []
        with self._lock:
            for i, req in enumerate(reqs):
                if req is None or req.finish is not None or req.cb_id != cb_ids[i]:
                    continue
                token = int(tokens[i])
                req.output_ids.append(token)
                req.logprobs.append(float(logprobs[i, token]))
                if token in req.stop_ids:
                    req.finish = {"type": "stop", "matched": token}
                elif len(req.output_ids) >= req.spec.max_new_tokens:
                    req.finish = {"type": "length", "length": req.spec.max_new_tokens}
                if req.finish is not None:  # CB ends it in this same step (same eos set and budget)
                    self._by_cb_id.pop(req.cb_id, None)
                    req.cb_id = None
                    self._release_kv(req)
                touched.append(req)
        for req in touched:
            if req.finish is not None or req.progress is not None:
                req.notify()
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot.scatter_(1, tokens.view(-1, 1), 0.0)
        return one_hot

    # ------------------------------------------------------------------ event loop: requests
    def _ensure_loop_state(self) -> None:
        if self._gate is None:
            self._gate = asyncio.Condition()
            self._update_lock = asyncio.Lock()

    def healthy(self) -> bool:
        if "kv_cache" in self._released:  # asleep on purpose (colocated training holds the device)
            return True
        return self._manager.is_running()

    def validate(self, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Per-request checks that SGLang does in its tokenizer manager (messages mirror SGLang's)."""
        if not prompt_ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                             f"({self.capacity} tokens).")
        total = len(prompt_ids) + spec.max_new_tokens
        if total > self.capacity:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.capacity} tokens. "
                f"You requested a total of {total} tokens: {len(prompt_ids)} tokens from the input messages and "
                f"{spec.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.")

    def has_request(self, rid: str) -> bool:
        """True while a request with this exact rid is admitted or waiting for KV (rids must be unique)."""
        return rid in self._live or rid in self._kv_queue

    def _kv_need(self, num_prompt: int, max_new_tokens: int) -> int:
        """Worst-case KV of a request in tokens, whole pages (retraction keeps it: the need is unchanged)."""
        return -(-(num_prompt + max_new_tokens) // self.page_size) * self.page_size

    def _kv_fits(self, need: int) -> bool:
        with self._lock:
            return self._kv_reserved + need <= self._kv_capacity

    def _release_kv(self, req: _Request) -> None:
        """Give back a finished request's KV reservation and wake waiting admissions. Caller holds the lock."""
        if req.kv_tokens:
            self._kv_reserved -= req.kv_tokens
            req.kv_tokens = 0
            req.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._notify_gate()))

    async def _notify_gate(self) -> None:
        async with self._gate:
            self._gate.notify_all()

    async def admit(self, *, rid: str, prompt_ids: list[int], spec: SamplingSpec, stream: bool = False) -> _Request:
        """Wait while paused, while a weight update drains, or until the request's KV fits; then hand it to CB."""
        self._ensure_loop_state()
        self.validate(prompt_ids, spec)
        need = self._kv_need(len(prompt_ids), spec.max_new_tokens)
        if rid in self._live or rid in self._kv_queue:
            raise ValueError(f"Duplicate request ID: {rid}")
        # As SGLang (_check_token_based_finish): ignore_eos turns off stop_token_ids as well as EOS.
        stop_ids = frozenset() if spec.ignore_eos else spec.stop_token_ids | self.eos_ids
        req = _Request(rid=rid, prompt_ids=list(prompt_ids), spec=spec, stop_ids=stop_ids,
                       loop=asyncio.get_running_loop(), stream=stream)
        self._kv_queue[rid] = req  # abortable while it waits for KV (SGLang's waiting queue)
        try:
            async with self._gate:
                await self._gate.wait_for(lambda: req.finish is not None or (
                    not self._paused and not self._released and self._num_updates_waiting == 0
                    and self._kv_fits(need)))
        finally:
            self._kv_queue.pop(rid, None)
        self._live[rid] = req
        if req.finish is not None:  # aborted while queued: answered like any aborted request
            return req
        with self._lock:
            self._kv_reserved += need
            req.kv_tokens = need
        if spec.max_new_tokens == 0:
            req.finish = {"type": "length", "length": 0}
            with self._lock:
                self._release_kv(req)
            req.done.set()
            if req.progress is not None:
                req.progress.set()
        else:
            self._submit(req)
        return req

    def _submit(self, req: _Request) -> None:
        from transformers.generation.continuous_batching.requests import RequestStatus

        cb_id = f"{req.rid}#{req.num_submissions}"
        req.num_submissions += 1
        with self._lock:
            self._by_cb_id[cb_id] = req
            req.cb_id = cb_id

        def on_output(output: Any) -> None:  # only failures matter: tokens and finishes come from the sampler
            if output.status == RequestStatus.FAILED:
                self._finalize(req, abort_reason(f"generation failed: {output.error}", 500, "InternalServerError"))

        self._manager.register_result_handler(cb_id, on_output)
        remaining = req.spec.max_new_tokens - len(req.output_ids)
        added = self._manager.add_request(req.prompt_ids + req.output_ids, request_id=cb_id, max_new_tokens=remaining,
                                          eos_token_id=sorted(req.stop_ids) or -1, streaming=False)
        if added is None:
            reason = abort_reason("the generation loop is not accepting requests", 503, "ServiceUnavailable")
            self._finalize(req, reason)

    def _leave_cb(self, req: _Request) -> None:
        """Take a request out of CB (its KV is released when CB processes the cancellation). Caller holds the lock."""
        if req.cb_id is None:
            return
        cb_id, req.cb_id = req.cb_id, None
        self._by_cb_id.pop(cb_id, None)
        self._manager.cancel_request(cb_id)
        router = self._manager.output_router  # cancelled requests never deliver: drop their handler
        with router._lock:
            router.result_handlers.pop(cb_id, None)

    def _finalize(self, req: _Request, finish: dict) -> None:
        with self._lock:
            if req.finish is None:
                req.finish = finish
            self._leave_cb(req)
            self._release_kv(req)
        req.done.set()
        if req.progress is not None:
            req.progress.set()

    def release(self, req: _Request) -> None:
        """Forget a request once its response is built."""
        if self._live.get(req.rid) is req:
            del self._live[req.rid]

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """SGLang abort_request: prefix match on rid (as SGLang's scheduler), or everything."""
        if not abort_all and not rid:
            return 0
        victims = [r for r in self._live.values() if r.finish is None and (abort_all or r.rid.startswith(rid))]
        for req in victims:
            self._finalize(req, abort_reason())
        queued = [] if self._paused else [  # requests held by a pause are not reached, as in SGLang
            r for r in self._kv_queue.values() if r.finish is None and (abort_all or r.rid.startswith(rid))]
        for req in queued:
            req.finish = abort_reason("Abort in waiting queue")
            req.done.set()
            if req.progress is not None:
                req.progress.set()
        if queued:
            asyncio.ensure_future(self._notify_gate())
        return len(victims) + len(queued)

    def snapshot(self, req: _Request, *, return_logprob: bool, return_text_in_logprobs: bool = False) -> dict:
        """The /generate response object for a request (final when req.finish is set)."""
        with self._lock:
            output_ids, logprobs, finish = list(req.output_ids), list(req.logprobs), req.finish
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.prompt_ids),
            "weight_version": self.weight_version,
            "num_retractions": req.num_retractions,
            "reasoning_tokens": 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
        }
        if finish is not None:
            spans = _version_spans(req.version_events, self.weight_version, len(output_ids))
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
            meta["e2e_latency"] = time.perf_counter() - req.created
        if return_logprob:
            texts: list[str | None] = [None] * len(output_ids)
            if return_text_in_logprobs and self.tokenizer is not None:
                texts = [self.tokenizer.decode([t]) for t in output_ids]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(logprobs, output_ids, texts)]
            meta["output_token_logprobs_length"] = len(output_ids)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True) if self.tokenizer is not None else None
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    # ------------------------------------------------------------------ pause / continue
    async def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        self._ensure_loop_state()
        async with self._gate:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
            return
        if self._manager is None:  # KV cache released: nothing is running
            return
        if self._pause_holder is None:
            holder = _PauseHolder(self._manager)
            await holder.acquire()
            self._pause_holder = holder
        if mode == "retract":
            with self._lock:
                for req in self._live.values():
                    if req.cb_id is not None and req.finish is None:
                        self._leave_cb(req)
                        req.num_retractions += 1
                        self._retracted.append(req)
            # Let CB process the cancellations (releasing the KV); nothing new is admitted while paused.
            self._pause_holder.release()
            self._pause_holder = None

    async def resume(self) -> None:
        self._ensure_loop_state()
        for req in self._retracted:
            if req.finish is None:
                self._submit(req)
        self._retracted = []
        if self._pause_holder is not None:
            self._pause_holder.release()
            self._pause_holder = None
        async with self._gate:
            self._paused = False
            self._gate.notify_all()

    def holds_kv(self) -> bool:
        with self._lock:
            return bool(self._by_cb_id)

    # ------------------------------------------------------------------ memory occupation (colocated mode)
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this process holds now: the served weights (live tensors) and its resident set."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"weights_bytes": weights, "rss_bytes": rss}

    def _idle_error(self) -> str:
        busy = [r.rid for r in self._live.values() if r.finish is None]
        if busy or self._retracted:
            return (f"release_memory_occupation should be called only when server is idle: "
                    f"{len(busy)} request(s) running ({', '.join(busy[:3])}{'...' if len(busy) > 3 else ''}); "
                    "pause_generation(mode=abort) first")
        return ""

    async def release_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """SGLang's /release_memory_occupation on CPU: `weights` frees every parameter's storage (the
        values are lost, as with SGLang's memory saver without CPU backup: push weights after resume),
        `kv_cache` stops the batching loop and frees its paged cache, `cuda_graph` has nothing to free.
        Requests that arrive meanwhile wait at admission until everything is resumed."""
        self._ensure_loop_state()
        tags = _memory_tags(tags)
        error = self._idle_error()
        if error:
            raise ValueError(error)
        before = self.memory_bytes()
        async with self._gate:
            new = [t for t in tags if t not in self._released]
            self._released.update(tags)
            self.num_releases += 1
        if "kv_cache" in new:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, block=True, timeout=10, hard_stop=True)
            del manager
        if "weights" in new:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    self._weight_meta[name] = (param.shape, param.dtype)
                    param.data = torch.empty(0, dtype=param.dtype)
        gc.collect()
        _malloc_trim()
        return {"released": sorted(self._released), "before": before, "after": self.memory_bytes()}

    async def resume_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """Take the released memory back. Resumed weights are zeros until the next weight update."""
        self._ensure_loop_state()
        tags = _memory_tags(tags)
        missing = [t for t in tags if t not in self._released and t != "cuda_graph"]
        if missing:
            raise ValueError(f"resume_memory_occupation: tag(s) {missing} are not released "
                             f"(released: {sorted(self._released) or 'none'})")
        before = self.memory_bytes()
        if "weights" in tags:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    shape, dtype = self._weight_meta.pop(name)
                    param.data = torch.zeros(shape, dtype=dtype)
        if "kv_cache" in tags:
            self._manager = await asyncio.to_thread(self._new_manager)
        async with self._gate:
            self._released.difference_update(tags)
            self._gate.notify_all()
        return {"released": sorted(self._released), "before": before, "after": self.memory_bytes()}

    # ------------------------------------------------------------------ weight updates
    async def run_weight_update(self, load: Callable[[], str], *, weight_version: str | None,
                                flush_cache: bool, abort_all_requests: bool = False) -> tuple[bool, str]:
        """Run `load` (in a thread, CB parked) with SGLang's locking: immediately when paused, otherwise after the
        in-flight requests finish while new ones wait. Returns (success, message) as SGLang's endpoints."""
        self._ensure_loop_state()
        if abort_all_requests:
            self.abort(abort_all=True)
        async with self._update_lock:
            if not self._paused:
                async with self._gate:
                    self._num_updates_waiting += 1
                try:
                    while any(r.finish is None for r in self._live.values()):
                        await asyncio.sleep(0.005)
                    success, message = await self._load_parked(load)
                finally:
                    async with self._gate:
                        self._num_updates_waiting -= 1
                        self._gate.notify_all()
            else:
                success, message = await self._load_parked(load)
        if success:
            self._set_version(weight_version)
            if weight_version is not None:
                message += f" Weight version updated to {weight_version}."
            if flush_cache and self.holds_kv():
                return False, _FLUSH_REFUSED
        return success, message

    def _parked(self) -> Any:
        """CB paused for the duration (nothing to pause while the KV cache, with its loop, is released)."""
        import contextlib

        return contextlib.nullcontext() if self._manager is None else self._manager.pause()

    async def _load_parked(self, load: Callable[[], str]) -> tuple[bool, str]:
        def parked() -> str:
            with self._parked():
                return load()
        try:
            return True, await asyncio.to_thread(parked)
        except Exception as error:
            logger.exception("weight update failed")
            return False, f"Failed to update weights: {error}"

    async def input_token_logprobs(self, prompt_ids: list[int], start: int, *,
                                   return_text: bool = False) -> list[list[Any]]:
        """SGLang's `meta_info.input_token_logprobs` for `logprob_start_len=start`: one
        [logprob, token_id, text] per prompt position start…end, the first logprob None (SGLang's logits
        start at that position). A teacher-forced forward of the served model, CB parked, no update running."""
        if start >= len(prompt_ids):
            return []

        @torch.no_grad()
        def forward() -> list[float]:
            if "weights" in self._released:
                raise ValueError("the weights are released (release_memory_occupation): resume them first")
            with self._parked():
                logits = self.model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
            logprobs = torch.log_softmax(logits[:-1], dim=-1)
            return logprobs.gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()

        self._ensure_loop_state()
        async with self._update_lock:
            values = await asyncio.to_thread(forward)
        ids = prompt_ids[start:]
        texts = ([self.tokenizer.decode([t]) for t in ids] if return_text and self.tokenizer is not None
                 else [None] * len(ids))
        return [[lp, t, text] for lp, t, text in zip([None] + values[start:], ids, texts)]

    def _set_version(self, new_version: str | None) -> None:
        if new_version is None or new_version == self.weight_version:
            return
        with self._lock:
            for req in self._live.values():
                if req.finish is None and req.output_ids:
                    req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = new_version

    def begin_session(self) -> tuple[bool, str]:
        if self._session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session_open = True
        return True, "Success"

    def end_session(self) -> tuple[bool, str]:
        if not self._session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session_open = False
        return True, "Success"

    def require_session(self, endpoint: str) -> None:
        if not self._session_open:
            raise ValueError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the served model in place (all names and shapes checked first)."""
        if "weights" in self._released:
            raise ValueError("the weights are released (release_memory_occupation): "
                             "resume_memory_occupation(tags=['weights']) before updating them")
        params = self.model.state_dict(keep_vars=True)  # includes tied aliases such as lm_head.weight
        for name, tensor in named:
            if name not in params:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"shape of {name}: got {tuple(tensor.shape)}, model has {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in named:
                params[name].data.copy_(tensor.to(dtype=params[name].dtype, device=params[name].device))

    def load_from_disk(self, model_path: str, load_format: str | None) -> str:
        from safetensors.torch import load_file

        if load_format not in (None, "auto", "safetensors", "pt"):
            raise ValueError(f"load_format {load_format!r} is not supported by the CPU engine (auto, safetensors, pt)")
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if files:
            named = [item for f in files for item in load_file(f).items()]
        else:
            files = sorted(glob.glob(os.path.join(model_path, "*.bin")))
            if not files:
                raise ValueError(f"no *.safetensors or *.bin weights in {model_path!r}")
            named = [item for f in files for item in torch.load(f, map_location="cpu", weights_only=True).items()]
        self.load_named_tensors(named)
        self.model_path = model_path
        self.load_format = load_format or "auto"
        return "Succeeded to update model weights."

    def load_from_tensor_payload(self, payload: bytes, load_format: str | None) -> str:
        data = safe_deserialize(payload)
        if load_format == "flattened_bucket":
            flat, metadata = data["flattened_tensor"], data["metadata"]
            named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
        elif load_format in (None, "direct"):
            named = [(name, t.get(0) if isinstance(t, LocalSerializedTensor) else t) for name, t in data]
        else:
            raise ValueError(f"Unknown load_format={load_format}")
        self.load_named_tensors(named)
        return "Success"

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> str:
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        self._groups[group_name] = new_weight_update_group(
            master_address=master_address, master_port=master_port, rank=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend)
        return "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> str:
        group = self._groups.pop(group_name, None)
        if group is None:
            raise ValueError("The group to be destroyed does not exist.")
        torch.distributed.destroy_process_group(group)
        return "Succeeded to destroy custom process group."

    def receive_broadcast(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                          load_format: str | None) -> str:
        """Receive one SGLang-style broadcast from rank 0 and load it (plain: one broadcast per tensor;
        flattened_bucket: one uint8 buffer holding every tensor back to back)."""
        if group_name not in self._groups:
            raise ValueError(f"Group {group_name} not in {list(self._groups)}. "
                             "Please call `init_weights_update_group` first.")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        group = self._groups[group_name]
        dtype_objs = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes]
        if load_format == "flattened_bucket":
            offsets, offset = [], 0
            for dtype, shape in zip(dtype_objs, shapes):
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor: byte offset {offset}, dtype {dtype}")
                size = math.prod(shape) * dtype.itemsize
                offsets.append((offset, offset + size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8)
            torch.distributed.broadcast(flat, src=0, group=group)
            named = [(n, flat[a:b].view(d).reshape(s)) for n, d, s, (a, b) in zip(names, dtype_objs, shapes, offsets)]
        elif load_format is None:
            named = [(n, torch.empty(s, dtype=d)) for n, d, s in zip(names, dtype_objs, shapes)]
            handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for _, t in named]
            for handle in handles:
                handle.wait()
        else:
            raise ValueError(f"Unknown load_format={load_format}")
        self.load_named_tensors(named)
        return "Succeeded to update parameter online."

    def shutdown(self) -> None:
        if self._pause_holder is not None:
            self._pause_holder.release()
        if self._manager is not None and self._manager.is_running():
            self._manager.stop(block=True, timeout=10, hard_stop=True)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory-occupation tags; none given = all of them."""


def _memory_tags(tags: list[str] | None) -> list[str]:
    if tags is None or len(tags) == 0:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags: {tags!r}; each must be one of {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------- update_weights_from_tensor payloads
@dataclasses.dataclass
class LocalSerializedTensor:
    """Stand-in for SGLang's LocalSerializedTensor: one serialized tensor per engine TP rank."""

    values: list

    def get(self, rank: int) -> torch.Tensor:
        return safe_deserialize(self.values[rank])


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (same fields)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Stand-in for SGLang's FlattenedTensorBucket so a pickled bucket can be rebuilt (data only)."""


_TORCH_MP = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                              "range", "set", "slice", "str", "tuple")
} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("_codecs", "encode"),
    ("multiprocessing.resource_sharer", "DupFd"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    (_TORCH_MP, "rebuild_tensor"), (_TORCH_MP, "rebuild_storage_fd"), (_TORCH_MP, "rebuild_storage_filename"),
    (_TORCH_MP, "rebuild_storage_empty"), (_TORCH_MP, "rebuild_typed_storage"),
    (_TORCH_MP, "rebuild_typed_storage_child"),
}
_STAND_INS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): FlattenedTensorBucket,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
}


class _SafeUnpickler(pickle.Unpickler):
    """Allowlist unpickler for SGLang's MultiprocessingSerializer payloads: tensors, storages shared through
    torch.multiprocessing, dtypes and plain containers; anything else (code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def safe_deserialize(data: bytes | str) -> Any:
    if isinstance(data, str):
        import base64

        data = base64.b64decode(data, validate=True)
    return _SafeUnpickler(io.BytesIO(data)).load()


def model_summary(engine: CpuEngine) -> dict:
    """GET /model_info, with SGLang 0.5.23's keys."""
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": engine.load_format,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(engine.hf_config, "model_type", None),
        "architectures": getattr(engine.hf_config, "architectures", None),
    }

