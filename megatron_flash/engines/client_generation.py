"""Generation-side calls of `EngineClient`: generate (one or n completions of one prompt), teacher-forced
scoring, abort, pause / continue and flush_cache. None is retried except flush_cache: whether to send
a generation again is the proxy's decision (rollout/proxy.py).
"""

from __future__ import annotations

import uuid
from typing import Any, List, Mapping, Optional, Sequence

from megatron_flash.engines.client_base import EngineTransport, MalformedReply, is_int
from megatron_flash.engines.client_replies import GenerateResult, label_by_adapter, parse_generate_reply

PAUSE_MODES = ("abort", "retract", "in_place")


class GenerationCalls(EngineTransport):
    """/generate, /abort_request, /pause_generation, /continue_generation and /flush_cache.

    ``lora_name``: with LoRA adapters pushed by name, every generation and scoring request names this
    adapter (SGLang's `lora_path`); None = the engine's own weights. Who pushes sets it."""

    lora_name: Optional[str] = None

    def _named(self, body: dict) -> dict:
        if self.lora_name is not None:
            body["lora_path"] = self.lora_name
        return body

    def _labelled(self, result: GenerateResult, lora_name: Optional[str]) -> GenerateResult:
        return result if lora_name is None else label_by_adapter(result, lora_name)

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       return_logprob: bool = True, rid: Optional[str] = None,
                       timeout_s: Optional[float] = None, return_routed_experts: bool = False) -> GenerateResult:
        """One prompt → one completion. Never retried here. ``rid`` defaults to a fresh uuid.
        ``return_routed_experts`` asks a MoE engine for its routes (SGLang needs
        ``--enable-return-routed-experts``; the field is only sent when asked)."""
        rid = rid or uuid.uuid4().hex
        body = self._named({"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                            "return_logprob": return_logprob, "rid": rid})
        if return_routed_experts:
            body["return_routed_experts"] = True
        reply = await self._call("POST", "/generate", body=body,
                                 timeout_s=timeout_s or self.request_timeout_s)
        return self._labelled(parse_generate_reply(reply, url=self.url, rid=rid, input_len=len(body["input_ids"]),
                                                   return_logprob=return_logprob,
                                                   return_routed_experts=return_routed_experts), body.get("lora_path"))

    async def score(self, batch_input_ids: Sequence[Sequence[int]], *, logprob_start_len: int,
                    top_logprobs_num: int = 0, timeout_s: Optional[float] = None) -> Any:
        """Teacher-forced input logprobs of a batch of sequences: one /generate with
        `max_new_tokens` 1 from `logprob_start_len` (and with `top_logprobs_num` > 0 the k most likely
        tokens at each position). Returns SGLang's reply as is (a list, one item per sequence, each with
        `meta_info.input_token_logprobs` and `input_top_logprobs`); the caller checks it."""
        body = self._named({"input_ids": [list(ids) for ids in batch_input_ids], "return_logprob": True,
                            "logprob_start_len": logprob_start_len,
                            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        return await self._call("POST", "/generate", body=body, timeout_s=timeout_s or self.request_timeout_s)

    async def generate_n(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], n: int, *,
                         return_logprob: bool = True, rid: Optional[str] = None,
                         timeout_s: Optional[float] = None,
                         return_routed_experts: bool = False) -> List[GenerateResult]:
        """One prompt → ``n`` completions in one request (SGLang parallel sampling, ``sampling_params.n``).

        SGLang answers a JSON list of n reply objects, each parsed like ``generate``'s. Each result's
        ``rid`` is the engine's ``meta_info.id``: SGLang 0.5.23 gives every sample a fresh uuid (not
        derived from ``rid``), the local engine ``f"{rid}_{i}"``. ``abort(rid)`` with the request's rid
        ends all n on the local engine but is a no-op on SGLang 0.5.23 (see docs/engines_client.md).
        n = 1 is a plain ``generate`` (SGLang then answers one object, not a list). Never retried here.
        """
        if not is_int(n) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if sampling_params.get("n", n) not in (n, None):
            raise ValueError(f"sampling_params.n={sampling_params['n']!r} contradicts n={n}")
        if n == 1:
            params = {k: v for k, v in sampling_params.items() if k != "n"}
            return [await self.generate(input_ids, params, return_logprob=return_logprob, rid=rid,
                                        timeout_s=timeout_s, return_routed_experts=return_routed_experts)]
        rid = rid or uuid.uuid4().hex
        body = self._named({"input_ids": list(input_ids), "sampling_params": {**sampling_params, "n": n},
                            "return_logprob": return_logprob, "rid": rid})
        if return_routed_experts:
            body["return_routed_experts"] = True
        reply = await self._call("POST", "/generate", body=body, timeout_s=timeout_s or self.request_timeout_s)
        if not isinstance(reply, list) or len(reply) != n:
            got = f"a list of {len(reply)}" if isinstance(reply, list) else f"a {type(reply).__name__}"
            raise MalformedReply(self.url, "/generate", "<body>", f"reply is {got}, expected a JSON list of "
                                 f"n={n} objects (asked with sampling_params.n={n})")
        return [self._labelled(parse_generate_reply(r, url=self.url, rid=f"{rid}_{i}", input_len=len(body["input_ids"]),
                                                    return_logprob=return_logprob,
                                                    return_routed_experts=return_routed_experts), body.get("lora_path"))
                for i, r in enumerate(reply)]

    async def abort(self, rid: str, *, timeout_s: Optional[float] = None) -> None:
        """Abort one request; its /generate call then answers with finish_reason abort."""
        await self._call("POST", "/abort_request", body={"rid": rid, "abort_all": False},
                         timeout_s=timeout_s or self.control_timeout_s, expect_json=False)

    async def abort_all(self, *, timeout_s: Optional[float] = None) -> None:
        await self._call("POST", "/abort_request", body={"rid": "", "abort_all": True},
                         timeout_s=timeout_s or self.control_timeout_s, expect_json=False)

    async def pause_generation(self, mode: str = "abort", *, timeout_s: Optional[float] = None) -> None:
        """abort: running requests end now with finish abort; retract: they go back to the waiting
        queue (KV freed, recomputed on resume); in_place: they stay, KV kept (flush_cache fails)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {'|'.join(PAUSE_MODES)}, got {mode!r}")
        await self._call("POST", "/pause_generation", body={"mode": mode},
                         timeout_s=timeout_s or self.control_timeout_s)

    async def continue_generation(self, *, timeout_s: Optional[float] = None) -> None:
        await self._call("POST", "/continue_generation", body={},
                         timeout_s=timeout_s or self.control_timeout_s)

    async def flush_cache(self, *, timeout_s: Optional[float] = None) -> None:
        """Drop the prefix cache. SGLang answers 400 while requests run: that is not retried."""
        await self._call_idempotent("POST", "/flush_cache", timeout_s=timeout_s or self.control_timeout_s,
                                    expect_json=False)
