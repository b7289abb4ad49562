"""The local engine's /generate request, SGLang's shape: parse the body into one item per prompt
(ids, sampling spec, logprob flags, rid), run or stream an item on the engine, and shape the reply
(`meta_info.input_token_logprobs` when asked). No HTTP here: local_routes.py calls these.
"""

import json
import uuid
from typing import Any, AsyncIterator

from megatron_flash.engines.sampling import SamplingSpec


def is_single(body: dict) -> bool:
    """A single-prompt request is answered with one object, a batch with a list (SGLang)."""
    ids = body.get("input_ids")
    return not (isinstance(ids, list) and ids and isinstance(ids[0], list)) and not isinstance(body.get("text"), list)


def _num_samples(params: list) -> int:
    """SGLang's parallel sampling count `sampling_params.n` (the same for every prompt of a request)."""
    counts = set()
    for p in params:
        value = p.get("n") if isinstance(p, dict) else None
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sampling_params.n must be a positive integer, got {value!r}")
        counts.add(value)
    if len(counts) > 1:
        raise ValueError(f"sampling_params.n must be the same for every prompt, got {sorted(counts)}")
    return counts.pop() if counts else 1


def _logprob_start_len(body: dict, index: int, prompt_len: int) -> int:
    """SGLang's `logprob_start_len` of prompt `index` (scalar or one per prompt; -1 = no input logprobs)."""
    value = body.get("logprob_start_len")
    if isinstance(value, list):
        value = value[min(index, len(value) - 1)] if value else None
    value = -1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {value!r}")
    if value > prompt_len:
        raise ValueError(f"logprob_start_len={value} is higher than the number of input tokens {prompt_len}. "
                         "Please use a smaller logprob_start_len.")
    return value


def _top_logprobs_num(value: Any, spec: SamplingSpec) -> int:
    """SGLang's `top_logprobs_num`. The local engine answers it for prompt scoring only (the top-k
    of a teacher-forced forward): a request that samples more than one new token is refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {value!r}")
    if value and spec.max_new_tokens > 1:
        raise ValueError(f"top_logprobs_num={value} is supported by the local engine for scoring requests only "
                         f"(sampling_params.max_new_tokens <= 1), got max_new_tokens={spec.max_new_tokens}")
    return value


def parse_generate(engine: Any, body: dict) -> list[dict]:
    """One dict per prompt: rid, prompt ids, sampling spec, logprob flags."""
    for key, neutral in (("token_ids_logprob", (None,)),
                         ("input_embeds", (None,)),
                         ("image_data", (None,))):
        if body.get(key) not in neutral:
            raise ValueError(f"{key} is not supported by the local engine")
    names = body.get("lora_path")
    names = names if isinstance(names, list) else [names]
    if len(set(map(str, names))) > 1:
        raise ValueError("lora_path must name one adapter for every prompt of a request on the local engine")
    adapter = engine.adapter_for_request(names[0] if names else None)
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise ValueError("Either text or input_ids should be provided.")
    if ids is None:
        if engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; send input_ids")
        texts = [text] if isinstance(text, str) else list(text)
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        single = isinstance(text, str)
    else:
        single = not ids or not isinstance(ids[0], list)
        prompts = [ids] if single else ids
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("input_ids must be a list of ints or a list of lists of ints")
    n = len(prompts)

    def per_item(name: str, default: Any) -> list:
        value = body.get(name)
        if isinstance(value, list) and not single:
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
            return [default if v is None else v for v in value]
        return [default if value is None else value] * n

    rid = body.get("rid")
    if single:
        rids = [rid if rid is not None else uuid.uuid4().hex]
    elif isinstance(rid, list):
        rids = per_item("rid", None)
    else:
        rids = [f"{rid}_{i}" if rid is not None else uuid.uuid4().hex for i in range(n)]
    params = body.get("sampling_params")
    params = params if isinstance(params, list) and not single else [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    num_samples = _num_samples(params)
    params = [{k: v for k, v in p.items() if k != "n"} if isinstance(p, dict) else p for p in params]
    logprob, text_lp = per_item("return_logprob", False), body.get("return_text_in_logprobs", False)
    routed = per_item("return_routed_experts", False)
    if num_samples > 1:
        # Parallel sampling: n requests of the one prompt, answered as a list of n objects (SGLang).
        # Sample i runs as "{rid}_{i}", so /abort_request with the parent rid reaches all n (prefix match).
        if not single:
            raise ValueError("sampling_params.n > 1 is supported for a single prompt only; "
                             "send one request per prompt")
        if body.get("stream"):
            raise ValueError("stream=true is not supported with sampling_params.n > 1 by the local engine")
        rids = [f"{rids[0]}_{i}" for i in range(num_samples)]
        taken = [r for r in rids if engine.has_request(r)]
        if taken:
            raise ValueError(f"Duplicate request ID: {taken[0]}")
        n, prompts, params, logprob = num_samples, prompts * num_samples, params * num_samples, \
            logprob * num_samples
        routed = routed * num_samples
    top = per_item("top_logprobs_num", 0) if num_samples == 1 else [body.get("top_logprobs_num") or 0] * n
    items = []
    for i in range(n):
        spec = SamplingSpec.from_json(params[i], vocab_size=engine.vocab_size)
        engine.validate(prompts[i], spec)
        items.append({"rid": str(rids[i]), "prompt_ids": prompts[i], "spec": spec,
                      "return_logprob": bool(logprob[i]), "return_text_in_logprobs": bool(text_lp),
                      "logprob_start_len": _logprob_start_len(body, i, len(prompts[i])),
                      "top_logprobs_num": _top_logprobs_num(top[i], spec),
                      "return_routed_experts": bool(routed[i]), "lora": adapter})
    return items if not single or num_samples > 1 else items[:1]

async def input_logprobs(engine: Any, item: dict) -> dict | None:
    """The input-logprob meta_info fields when asked with return_logprob (logprob_start_len >= 0, or
    top_logprobs_num for the first output token); None when not asked."""
    top = item["top_logprobs_num"] if item["return_logprob"] else 0
    if not item["return_logprob"] or (item["logprob_start_len"] < 0 and not top):
        return None
    start = item["logprob_start_len"] if item["logprob_start_len"] >= 0 else len(item["prompt_ids"])
    return await engine.input_token_logprobs(item["prompt_ids"], start, return_text=item["return_text_in_logprobs"],
                                             top_k=top)

def with_inputs(out: dict, inputs: dict | None) -> dict:
    """The reply with the input fields; `output_top_logprobs` (top_logprobs_num) is the top-k after
    the prompt for the one token a scoring request may sample, [] before it is sampled."""
    if inputs is not None:
        meta = out["meta_info"]
        meta["input_token_logprobs"] = inputs["input_token_logprobs"]
        if "input_top_logprobs" in inputs:
            meta["input_top_logprobs"] = inputs["input_top_logprobs"]
            meta["output_top_logprobs"] = [inputs["last_top_logprobs"]] * len(out["output_ids"])
    return out

async def run_one(engine: Any, item: dict) -> dict:
    inputs = await input_logprobs(engine, item)
    req = await engine.admit(rid=item["rid"], prompt_ids=item["prompt_ids"], spec=item["spec"],
                             return_routed_experts=item["return_routed_experts"])
    try:
        await req.done.wait()
        return with_adapter(engine, item, with_inputs(engine.snapshot(
            req, return_logprob=item["return_logprob"], return_text_in_logprobs=item["return_text_in_logprobs"],
            return_routed_experts=item["return_routed_experts"]), inputs))
    finally:
        engine.release(req)


def with_adapter(engine: Any, item: dict, out: dict) -> dict:
    """A request that named a LoRA adapter learns which one it ran on (engines/local_lora.py)."""
    if item.get("lora") is not None:
        out["meta_info"]["lora_path"] = engine._lora_current or item["lora"]
    return out

async def stream_one(engine: Any, item: dict) -> AsyncIterator[bytes]:
    try:
        inputs = await input_logprobs(engine, item)
        req = await engine.admit(rid=item["rid"], prompt_ids=item["prompt_ids"], spec=item["spec"], stream=True,
                                 return_routed_experts=item["return_routed_experts"])
    except ValueError as error:
        payload = {"error": {"message": str(error), "type": "invalid_request_error", "code": 400,
                             "retryable": False}}
        yield b"data: " + json.dumps(payload).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
        return
    try:
        sent = -1
        while True:
            await req.progress.wait()
            req.progress.clear()
            out = with_adapter(engine, item, with_inputs(engine.snapshot(
                req, return_logprob=item["return_logprob"], return_text_in_logprobs=item["return_text_in_logprobs"],
                return_routed_experts=item["return_routed_experts"]), inputs))
            if len(out["output_ids"]) != sent or req.finish is not None:
                sent = len(out["output_ids"])
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
            if out["meta_info"]["finish_reason"] is not None:
                break
        yield b"data: [DONE]\n\n"
    finally:
        if req.finish is None:  # client went away
            engine.abort(rid=req.rid)
        engine.release(req)
