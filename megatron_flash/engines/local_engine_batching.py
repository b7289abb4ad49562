"""The local engine's hooks into transformers' continuous batching (CB): the CB manager it runs, the
logits processor that samples inside each CB step, and the thread that holds CB's `pause()`. A mixin
of `LocalEngine` (engines/local_engine.py), which owns the state used here: `model`, `eos_ids`,
`step_profile`, `route_recorder`, `_lock`, the `_by_cb_id` requests and `_release_kv`.

Why a sampler inside CB: CB's own sampling reports logprobs of the *processed* logits and decides greedy
vs sampling for the whole manager. SGLang reports log_softmax(logits / T) before top-k/top-p/min-p
(T = 1 for greedy) and mixes greedy and sampled requests in one batch. So the engine installs one CB
logits processor (`_SGLangSampler`) that sees the raw fp32 logits of every row that gets a new token,
picks the token itself with SGLang's semantics, records (token, raw logprob) on the request, and returns
a one-hot score row so that CB, decoding greedily (do_sample=False: an argmax, where its sampling would
run a softmax and a multinomial over the whole vocabulary once more, 40 ms a step for 64 rows of a 32k
vocabulary on one core), takes exactly that token. CB keeps everything else: the paged
cache, continuous batching, split prefill, cancellation, and `pause()` for in-place weight writes.
Our records are the source of truth for outputs, which also fixes "cancel yields no final output".
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from megatron_flash.engines.sampling import sample_rows


def _make_sampler_processor(engine: ContinuousBatchingHooks) -> Any:
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
            engine._sample_step(self.rows, scores[:n])  # rewrites those rows in place
            return scores

    return _SGLangSampler()


class PauseHolder:
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


class CBDecoder:
    """transformers' CB manager behind the decoder protocol the engine drives (`add`, `cancel`,
    `pause`, `is_running`, `start`, `stop`, `reset_graphs`; the static decoder has the same)."""

    def __init__(self, engine: Any, *, num_blocks: int, page_size: int, max_batch_tokens: int,
                 seed: int | None) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )
        from transformers.generation.logits_process import LogitsProcessorList

        self.engine = engine
        generation_config = GenerationConfig(do_sample=False, eos_token_id=sorted(engine.eos_ids) or -1)
        cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens,
            allow_block_sharing=False,  # no prefix cache: KV written under old weights is never reused
            use_async_batching=False, use_cuda_graph=False, return_logprobs=False, seed=seed,
        )
        recorder = engine.route_recorder

        class _Processors(ContinuousBatchingLogitsProcessorList):
            # CB hands the whole step's requests only here, before the forward: the route recorder
            # needs every request's query tokens, the sampler those with a new token.
            def prepare_tensor_args(self, requests_in_batch: list, arg_storage: torch.Tensor) -> torch.Tensor:
                recorder.note_batch(requests_in_batch)
                return super().prepare_tensor_args(requests_in_batch, arg_storage)

        self.manager = engine.model.init_continuous_batching(generation_config=generation_config,
                                                             continuous_batching_config=cb_config)
        processors = _Processors(LogitsProcessorList([_make_sampler_processor(engine)]))
        processors.tensors_required = 1  # one int32 row of per-request arguments (unused; rows come from prepare)
        self.manager.logit_processor = processors
        engine.step_floor.install(self.manager)  # --decode-step-ms (inside the profile's timing: step_s holds it)
        engine.step_profile.install(self.manager)

    def start(self) -> None:
        self.manager.start()

    def is_running(self) -> bool:
        return self.manager.is_running()

    def stop(self, **kwargs: Any) -> None:
        self.manager.stop(**kwargs)

    def pause(self) -> Any:
        return self.manager.pause()

    def reset_graphs(self) -> None:  # CB runs without CUDA graphs here
        pass

    def add(self, cb_id: str, req: Any, token_ids: list[int]) -> bool:
        from transformers.generation.continuous_batching.requests import RequestStatus

        def on_output(output: Any) -> None:  # only failures matter: tokens and finishes come from the sampler
            if output.status == RequestStatus.FAILED:
                self.engine._fail(req, output.error)

        self.manager.register_result_handler(cb_id, on_output)
        remaining = req.spec.max_new_tokens - len(req.output_ids)
        added = self.manager.add_request(token_ids, request_id=cb_id, max_new_tokens=remaining,
                                         eos_token_id=sorted(req.stop_ids) or -1, streaming=False)
        return added is not None

    def cancel(self, cb_id: str) -> None:
        self.manager.cancel_request(cb_id)
        router = self.manager.output_router  # cancelled requests never deliver: drop their handler
        with router._lock:
            router.result_handlers.pop(cb_id, None)


class DecodingHooks:
    """What runs on the decoder's thread: route lookup, CB's sampling step, and recording tokens."""

    def _routes_of(self, cb_id: str) -> torch.Tensor | None:
        req = self._by_cb_id.get(cb_id)  # read without the lock: the decoder thread is the only writer of rows
        return None if req is None else req.routes

    # ------------------------------------------------------------------ CB thread: sampling
    @torch.no_grad()
    def _sample_step(self, cb_ids: list[str], scores: torch.Tensor) -> torch.Tensor:
        started, slept = time.perf_counter(), 0.0
        try:
            with self._lock:
                reqs = [self._by_cb_id.get(cb_id) for cb_id in cb_ids]
            specs = [None if r is None else r.spec for r in reqs]
            banned = [sorted(r.stop_ids) if r is not None and len(r.output_ids) < r.spec.min_new_tokens else []
                      for r in reqs]
            tokens, logprobs = sample_rows(scores, specs, [None if r is None else r.generator for r in reqs], banned)
            picked = logprobs.gather(1, tokens.view(-1, 1))[:, 0].tolist()  # one device→host copy per step
            slept = self.step_floor.pad_step()  # --decode-step-ms: tokens leave T after the step began
            self._record(cb_ids, tokens.tolist(), picked)
            # In place: CB reads these logits only through what this processor returns.
            return scores.fill_(float("-inf")).scatter_(1, tokens.view(-1, 1), 0.0)
        finally:
            self.step_profile.add_sampler(time.perf_counter() - started - slept)

    def _record(self, cb_ids: list[str], token_ids: list[int], logprobs: list[float]) -> None:
        """Append one token per request (cb_ids no longer live are skipped) and decide finishes; a finished
        request leaves the decoder (CB ends it in the same step: same eos set and budget; the static
        decoder frees its slot on its next pass)."""
        touched = []
        with self._lock:
            for cb_id, token, logprob in zip(cb_ids, token_ids, logprobs):
                req = self._by_cb_id.get(cb_id)
                if req is None or req.finish is not None or req.cb_id != cb_id:
                    continue
                req.output_ids.append(token)
                req.logprobs.append(logprob)
                if token in req.stop_ids:
                    req.finish = {"type": "stop", "matched": token}
                elif len(req.output_ids) >= req.spec.max_new_tokens:
                    req.finish = {"type": "length", "length": req.spec.max_new_tokens}
                if req.finish is not None:
                    self._by_cb_id.pop(req.cb_id, None)
                    req.cb_id = None
                    self._release_kv(req)
                touched.append(req)
        for req in touched:
            if req.finish is not None or req.progress is not None:
                req.notify()
