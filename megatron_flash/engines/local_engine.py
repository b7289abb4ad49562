"""Generation engine of the local engine server: transformers continuous batching (CB) with SGLang sampling.

The HTTP layer (`local_server.py`) is thin; the SGLang contract lives here and beside it: sampling semantics
in `sampling.py`, memory hand-off and weight updates in `local_engine_updates.py`, the CB manager, the
in-step sampler and the pause holder in `local_engine_batching.py` (both mixins of this class), the
accepted weight payloads in `weight_payloads.py`. Why the engine samples inside CB's step, rather than
letting CB sample: `local_engine_batching.py`.

    HTTP coroutine ──admit (waits while paused / updating)──► _Request ──add_request──► CB manager thread
         ▲                                                                               │ paged KV, scheduling,
         └──── done event ◄── finish detected by _SGLangSampler, inside the CB step ◄────┘ prefill chunking

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
import logging
import os
import threading
import time
from typing import Any

import torch

from megatron_flash.engines.local_engine_batching import CBDecoder, DecodingHooks, PauseHolder
from megatron_flash.engines.local_engine_updates import EngineUpdates
from megatron_flash.engines.local_lora import EngineAdapters
from megatron_flash.engines.cuda_handles import device_uuid
from megatron_flash.engines.routed_experts import RouteRecorder, encoded_routes
from megatron_flash.engines.shared_weights import SharedBufferMaps
from megatron_flash.engines.sampling import SamplingSpec
from megatron_flash.engines.step_profile import StepFloor, StepProfile

logger = logging.getLogger(__name__)


def abort_reason(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


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
        self.kv_tokens = 0  # KV reserved for this request (see LocalEngine._kv_need), 0 once released
        self.version_events: list[tuple[str, int]] = []  # (version before a change, tokens generated under it)
        self.routes: torch.Tensor | None = None  # MoE routing table when asked (see routed_experts.py)
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


class LocalEngine(EngineUpdates, EngineAdapters, DecodingHooks):
    """SGLang-contract generation engine on transformers continuous batching (any torch device and
    dtype: CPU fp32 by default; `device="cuda", dtype="bfloat16"` on a GPU).

    All public coroutines run on one asyncio loop; the CB loop runs in its own thread.
    """

    def __init__(self, *, model_path: str, decoder: str = "static", num_blocks: int = 64, page_size: int = 16,
                 max_batch_tokens: int | None = None, max_running_requests: int | None = None,
                 context_length: int | None = None, max_prefill_tokens: int | None = None,
                 cuda_graphs: bool = True, seed: int | None = None, device: str = "cpu",
                 dtype: str = "float32", enable_lora: bool = False, decode_step_ms: float = 0.0) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"--model-path {model_path!r} is not a Hugging Face model directory (no config.json)")
        self.model_path = model_path
        self.tokenizer_path = model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.device, self.dtype = engine_device(device), engine_dtype(dtype)
        # which physical GPU (CUDA indices differ between processes): a trainer rank on the same GPU cannot
        # broadcast to this engine over NCCL (weight_sync/transports/broadcast.py refuses it by this UUID)
        self.device_uuid = device_uuid(torch.cuda.current_device() if self.device.index is None
                                       else self.device.index) if self.device.type == "cuda" else None
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception as error:  # a checkpoint without tokenizer still serves input_ids
            logger.warning("no tokenizer at %s (%s): text fields will be null", model_path, error)
            self.tokenizer = None
        self.vocab_size = int(self.hf_config.get_text_config().vocab_size)
        eos = [self.model.generation_config.eos_token_id, self.hf_config.eos_token_id]
        self.eos_ids = frozenset(t for e in eos for t in ([e] if isinstance(e, int) else (e or [])) if t >= 0)
        if decoder not in DECODERS:
            raise ValueError(f"--decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
        # a flag of the other decoder would change nothing: refused by name
        other = ({"--max-batch-tokens": max_batch_tokens} if decoder == "static" else
                 {"--max-running-requests": max_running_requests, "--context-length": context_length,
                  "--max-prefill-tokens": max_prefill_tokens, "--disable-cuda-graph": None if cuda_graphs else True})
        misplaced = sorted(flag for flag, value in other.items() if value is not None)
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)} do(es) not apply to --decoder {decoder}")
        max_batch_tokens = max_batch_tokens or 256
        max_running_requests = max_running_requests or 64
        for flag, value in (("--max-running-requests", max_running_requests), ("--context-length", context_length),
                            ("--max-prefill-tokens", max_prefill_tokens), ("--max-batch-tokens", max_batch_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not 0 <= decode_step_ms < float("inf"):  # NaN too
            raise ValueError(f"--decode-step-ms must be a finite number of milliseconds >= 0, got {decode_step_ms}")
        self.decode_step_ms = float(decode_step_ms)  # a floor on the decode step's cost (step_profile.StepFloor)
        max_positions = getattr(self.hf_config.get_text_config(), "max_position_embeddings", None) or 1 << 30
        self.decoder = decoder
        if decoder == "static":
            # one slot per running request, each as long as a request may be; the gate counts slots
            self.capacity = min(context_length or num_blocks * page_size, int(max_positions))
            self.page_size = self.capacity
            self._kv_capacity = max_running_requests * self.capacity
        else:
            self.capacity = min(num_blocks * page_size, int(max_positions))
            self.page_size = page_size
            self._kv_capacity = num_blocks * page_size
        self.num_blocks, self.max_batch_tokens = num_blocks, max_batch_tokens
        self.weight_version = "default"
        self.load_format = "auto"
        self._init_lora(enable_lora)

        self._lock = threading.Lock()  # guards _by_cb_id, the token lists of requests and _kv_reserved
        # Admission control: transformers' batcher fails requests (and may wedge) when the running requests
        # need more KV than the cache holds, so a request enters the decoder only once its worst case fits.
        self._kv_reserved = 0
        self._by_cb_id: dict[str, _Request] = {}
        self._live: dict[str, _Request] = {}
        self._kv_queue: dict[str, _Request] = {}  # admitted by HTTP, waiting at the gate
        self._paused = False
        self._pause_holder: PauseHolder | None = None
        self._retracted: list[_Request] = []
        self._num_updates_waiting = 0
        self._gate: asyncio.Condition | None = None
        self._update_lock: asyncio.Lock | None = None
        self._session_open = False
        self._groups: dict[str, Any] = {}
        self._shared_buffers = SharedBufferMaps()  # the bridge's staged ipc buffers, mapped once

        self._released: set[str] = set()  # memory tags given back (release_memory_occupation)
        self.num_releases = 0
        self._weight_meta: dict[str, tuple[torch.Size, torch.dtype]] = {}

        self.step_profile = StepProfile()
        self.step_floor = StepFloor(self.decode_step_ms, self.step_profile)
        self.route_recorder = RouteRecorder(self.model, self._routes_of)
        def new_decoder() -> Any:  # the KV cache lives in the decoder: made again on resume
            if decoder == "static":
                from megatron_flash.engines.static_decoder import StaticDecoder

                made: Any = StaticDecoder(self, num_slots=max_running_requests, slot_len=self.capacity, seed=seed,
                                          max_prefill_tokens=max(max_prefill_tokens or 8192, self.capacity),
                                          use_graphs=cuda_graphs)
            else:
                made = CBDecoder(self, num_blocks=num_blocks, page_size=page_size,
                                 max_batch_tokens=max_batch_tokens, seed=seed)
            made.start()
            return made

        self._new_decoder = new_decoder
        self._decoder = self._new_decoder()

    # ------------------------------------------------------------------ event loop: requests
    def _ensure_loop_state(self) -> None:
        if self._gate is None:
            self._gate = asyncio.Condition()
            self._update_lock = asyncio.Lock()

    def healthy(self) -> bool:
        if "kv_cache" in self._released:  # asleep on purpose (colocated training holds the device)
            return True
        return self._decoder.is_running()

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

    async def admit(self, *, rid: str, prompt_ids: list[int], spec: SamplingSpec, stream: bool = False,
                    return_routed_experts: bool = False) -> _Request:
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
        if return_routed_experts and self.route_recorder.is_moe:
            req.routes = self.route_recorder.new_table(len(prompt_ids) + spec.max_new_tokens)
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
        cb_id = f"{req.rid}#{req.num_submissions}"
        req.num_submissions += 1
        with self._lock:
            self._by_cb_id[cb_id] = req
            req.cb_id = cb_id
        if not self._decoder.add(cb_id, req, req.prompt_ids + req.output_ids):
            reason = abort_reason("the generation loop is not accepting requests", 503, "ServiceUnavailable")
            self._finalize(req, reason)

    def _leave_cb(self, req: _Request) -> None:
        """Take a request out of CB (its KV is released when CB processes the cancellation). Caller holds the lock."""
        if req.cb_id is None:
            return
        cb_id, req.cb_id = req.cb_id, None
        self._by_cb_id.pop(cb_id, None)
        self._decoder.cancel(cb_id)

    def _finalize(self, req: _Request, finish: dict) -> None:
        with self._lock:
            if req.finish is None:
                req.finish = finish
            self._leave_cb(req)
            self._release_kv(req)
        req.done.set()
        if req.progress is not None:
            req.progress.set()

    def _fail(self, req: _Request, error: Any) -> None:
        """The decoder could not generate for `req` (any thread): it ends with a 500 abort."""
        req.loop.call_soon_threadsafe(self._finalize, req,
                                      abort_reason(f"generation failed: {error}", 500, "InternalServerError"))

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

    def snapshot(self, req: _Request, *, return_logprob: bool, return_text_in_logprobs: bool = False,
                 return_routed_experts: bool = False) -> dict:
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
            rows = len(req.prompt_ids) + len(output_ids) - 1
            if return_routed_experts and req.routes is not None and rows > 0:
                meta["routed_experts"] = encoded_routes(req.routes, rows)
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
        if self._decoder is None:  # KV cache released: nothing is running
            return
        if self._pause_holder is None:
            holder = PauseHolder(self._decoder)
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

    def shutdown(self) -> None:
        if self._pause_holder is not None:
            self._pause_holder.release()
        if self._decoder is not None and self._decoder.is_running():
            self._decoder.stop(block=True, timeout=10, hard_stop=True)


def model_summary(engine: LocalEngine) -> dict:
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


DTYPES = ("float32", "bfloat16", "float16")
DECODERS = ("static", "cb")


def engine_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def engine_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r}: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: this torch has no usable CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"--device must be cpu or cuda[:N], got {name!r}")
    return device
