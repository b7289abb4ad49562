"""CPU engine server: SGLang 0.5.23's native HTTP API over `CpuEngine` (transformers continuous batching).

    python -m megatron_flash.engines.cpu_server --model-path runs/tiny_model --port 30000
    python -m megatron_flash.engines.cpu_server --model-path DIR --port N --host 0.0.0.0 --api-key KEY

Request and response JSON follow SGLang (see docs/engines.md for the fields and the few deviations), so
one client drives both. The handlers are thin: parse, call the engine, shape SGLang's response.

Security: with --api-key every endpoint but /health* and /ready needs `Authorization: Bearer KEY`
(401 otherwise, as SGLang). /update_weights_from_tensor unpickles its payload like SGLang does, through an
allowlist unpickler (tensors, torch shared-memory storages, containers; no code) — still, only expose it to
trusted peers: when bound to a non-loopback host without --api-key the weight-update endpoints answer 403.
"""

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import sys
import uuid
from typing import Any, AsyncIterator

logger = logging.getLogger("megatron_flash.cpu_server")

_WEIGHT_ENDPOINTS = ("/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
                     "/update_weights_from_distributed", "/destroy_weights_update_group")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def build_app(engine: Any, *, api_key: str | None = None, host: str = "127.0.0.1") -> Any:
    """The FastAPI app serving `engine` (a `CpuEngine`)."""
    import hmac

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from megatron_flash.engines.cpu_engine import model_summary
    from megatron_flash.engines.sampling import SamplingSpec

    app = FastAPI()
    weight_updates_exposed = api_key is not None or _is_loopback(host)

    def bad_request(message: str) -> JSONResponse:
        # SGLang's shape for a body FastAPI cannot validate (its RequestValidationError handler).
        return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None,
                             "code": 400}, status_code=400)

    def value_error(error: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)  # SGLang _create_error_response

    def outcome(success: bool, message: str, **extra: Any) -> JSONResponse:
        return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)

    class BodyError(Exception):
        pass

    async def body_of(request: Request, *required: str) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BodyError(f"JSON decode error: {error}") from None
        if not isinstance(body, dict):
            raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
        missing = [k for k in required if k not in body]
        if missing:
            raise BodyError(f"missing required field(s): {', '.join(missing)}")
        return body

    @app.exception_handler(BodyError)
    async def on_body_error(request: Request, error: BodyError) -> JSONResponse:
        return bad_request(str(error))

    def refusal(scope: dict) -> JSONResponse | None:
        path = scope["path"]
        if path.startswith(("/health", "/ready")):
            return None
        if api_key is not None:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        elif path in _WEIGHT_ENDPOINTS and not weight_updates_exposed:
            return JSONResponse({"error": f"{path} is disabled on a non-loopback host without --api-key"},
                                status_code=403)
        return None

    class Authorize:
        """The token check (SGLang's --api-key: `Authorization: Bearer KEY`) and the weight-endpoint guard
        as plain ASGI middleware: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) runs every
        request through an extra task and memory streams, which cost the engine's one event loop
        ~0.3 ms per request (benchmarks/engine_step_cost.py --loop-k; docs/benchmarks.md)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            denied = refusal(scope) if scope["type"] == "http" else None
            if denied is not None:
                await denied(scope, receive, send)
                return
            await self.inner(scope, receive, send)

    app.add_middleware(Authorize)

    # ---------------------------------------------------------------- status
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy() else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if engine.healthy() else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return model_summary(engine)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"model_path": engine.model_path, "context_length": engine.capacity,
                "max_total_num_tokens": engine.num_blocks * engine.page_size, "page_size": engine.page_size,
                "max_batch_tokens": engine.max_batch_tokens, "weight_version": engine.weight_version,
                "version": "megatron-flash-cpu", "internal_states": [],
                "memory_released": sorted(engine._released), "memory_releases": engine.num_releases,
                **engine.memory_bytes()}

    # ---------------------------------------------------------------- generation
    def parse_generate(body: dict) -> list[dict]:
        """One dict per prompt: rid, prompt ids, sampling spec, logprob flags."""
        for key, neutral in (("top_logprobs_num", (None, 0)), ("token_ids_logprob", (None,)),
                             ("input_embeds", (None,)),
                             ("image_data", (None,)), ("lora_path", (None,))):
            if body.get(key) not in neutral:
                raise ValueError(f"{key} is not supported by the CPU engine")
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
        if num_samples > 1:
            # Parallel sampling: n requests of the one prompt, answered as a list of n objects (SGLang).
            # Sample i runs as "{rid}_{i}", so /abort_request with the parent rid reaches all n (prefix match).
            if not single:
                raise ValueError("sampling_params.n > 1 is supported for a single prompt only; "
                                 "send one request per prompt")
            if body.get("stream"):
                raise ValueError("stream=true is not supported with sampling_params.n > 1 by the CPU engine")
            rids = [f"{rids[0]}_{i}" for i in range(num_samples)]
            taken = [r for r in rids if engine.has_request(r)]
            if taken:
                raise ValueError(f"Duplicate request ID: {taken[0]}")
            n, prompts, params, logprob = num_samples, prompts * num_samples, params * num_samples, \
                logprob * num_samples
        items = []
        for i in range(n):
            spec = SamplingSpec.from_json(params[i], vocab_size=engine.vocab_size)
            engine.validate(prompts[i], spec)
            items.append({"rid": str(rids[i]), "prompt_ids": prompts[i], "spec": spec,
                          "return_logprob": bool(logprob[i]), "return_text_in_logprobs": bool(text_lp),
                          "logprob_start_len": _logprob_start_len(body, i, len(prompts[i]))})
        return items if not single or num_samples > 1 else items[:1]

    async def input_logprobs(item: dict) -> list | None:
        """meta_info.input_token_logprobs when asked with return_logprob and logprob_start_len >= 0."""
        if not item["return_logprob"] or item["logprob_start_len"] < 0:
            return None
        return await engine.input_token_logprobs(item["prompt_ids"], item["logprob_start_len"],
                                                 return_text=item["return_text_in_logprobs"])

    def with_inputs(out: dict, inputs: list | None) -> dict:
        if inputs is not None:
            out["meta_info"]["input_token_logprobs"] = inputs
        return out

    async def run_one(item: dict) -> dict:
        inputs = await input_logprobs(item)
        req = await engine.admit(rid=item["rid"], prompt_ids=item["prompt_ids"], spec=item["spec"])
        try:
            await req.done.wait()
            return with_inputs(engine.snapshot(req, return_logprob=item["return_logprob"],
                                               return_text_in_logprobs=item["return_text_in_logprobs"]), inputs)
        finally:
            engine.release(req)

    async def stream_one(item: dict) -> AsyncIterator[bytes]:
        try:
            inputs = await input_logprobs(item)
            req = await engine.admit(rid=item["rid"], prompt_ids=item["prompt_ids"], spec=item["spec"], stream=True)
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
                out = with_inputs(engine.snapshot(req, return_logprob=item["return_logprob"],
                                                  return_text_in_logprobs=item["return_text_in_logprobs"]), inputs)
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

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await body_of(request)
        try:
            items = parse_generate(body)
        except (ValueError, TypeError) as error:
            return value_error(error)
        single = len(items) == 1 and not (isinstance(body.get("input_ids"), list) and body["input_ids"]
                                          and isinstance(body["input_ids"][0], list)) \
            and not isinstance(body.get("text"), list)
        if body.get("stream"):
            if not single:
                return value_error(ValueError("stream=true is supported for a single prompt only"))
            return StreamingResponse(stream_one(items[0]), media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(run_one(item) for item in items))
        except ValueError as error:
            return value_error(error)
        return JSONResponse(outs[0] if single else list(outs))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await body_of(request)
        engine.abort(rid=str(body.get("rid") or ""), abort_all=bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        body = await body_of(request)
        try:
            await engine.pause(body.get("mode", "abort"))
        except ValueError as error:
            return bad_request(str(error))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Any:
        await body_of(request)
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # No prefix cache is kept (block sharing off), so a flush only has to refuse while requests hold KV.
        if engine.holds_kv():
            return Response("Flush cache failed.\n", status_code=400)
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", status_code=200)

    # ---------------------------------------------------------------- memory occupation (colocated mode)
    async def memory_call(request: Request, call: Any) -> Any:
        body = await body_of(request)
        try:
            return JSONResponse(await call(body.get("tags")))
        except ValueError as error:
            return value_error(error)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Any:
        return await memory_call(request, engine.release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Any:
        return await memory_call(request, engine.resume_memory)

    # ---------------------------------------------------------------- weights
    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await body_of(request, "new_version")
        if body.get("abort_all_requests", True):
            engine.abort(abort_all=True)
        engine._set_version(str(body["new_version"]))
        return JSONResponse({"success": True, "message": f"Weight version updated to {body['new_version']}",
                             "new_version": body["new_version"]})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Any:
        body = await body_of(request, "model_path")
        path, load_format = str(body["model_path"]), body.get("load_format")
        success, message = await engine.run_weight_update(
            lambda: engine.load_from_disk(path, load_format), weight_version=body.get("weight_version"),
            flush_cache=body.get("flush_cache", True), abort_all_requests=body.get("abort_all_requests", False))
        return outcome(success, message, num_paused_requests=0)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> Any:
        await body_of(request)
        return outcome(*engine.begin_session())

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> Any:
        await body_of(request)
        return outcome(*engine.end_session())

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Any:
        body = await body_of(request, "serialized_named_tensors")
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            return bad_request("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        try:
            engine.require_session("update_weights_from_tensor")
        except ValueError as error:
            return outcome(False, str(error))
        load_format = body.get("load_format")
        success, message = await engine.run_weight_update(
            lambda: engine.load_from_tensor_payload(payloads[0], load_format),
            weight_version=body.get("weight_version"), flush_cache=body.get("flush_cache", True),
            abort_all_requests=body.get("abort_all_requests", False))
        return outcome(success, message)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Any:
        body = await body_of(request, "master_address", "master_port", "rank_offset", "world_size")
        try:
            message = await asyncio.to_thread(
                engine.init_group, master_address=str(body["master_address"]), master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]), world_size=int(body["world_size"]),
                group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"))
        except Exception as error:
            return outcome(False, f"Failed to initialize custom process group: {error}.")
        return outcome(True, message)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Any:
        body = await body_of(request)
        try:
            return outcome(True, engine.destroy_group(body.get("group_name", "weight_update_group")))
        except Exception as error:
            return outcome(False, str(error))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Any:
        body = await body_of(request, "names", "dtypes", "shapes")
        try:
            engine.require_session("update_weights_from_distributed")
        except ValueError as error:
            return outcome(False, str(error))
        kwargs = {"names": list(body["names"]), "dtypes": list(body["dtypes"]), "shapes": list(body["shapes"]),
                  "group_name": body.get("group_name", "weight_update_group"), "load_format": body.get("load_format")}
        success, message = await engine.run_weight_update(
            lambda: engine.receive_broadcast(**kwargs), weight_version=body.get("weight_version"),
            flush_cache=body.get("flush_cache", True), abort_all_requests=body.get("abort_all_requests", False))
        return outcome(success, message)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory (config.json, weights)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (as SGLang)")
    parser.add_argument("--num-blocks", type=int, default=64, help="KV cache blocks (of --page-size tokens)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per forward step")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling RNG")
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"error: --model-path {args.model_path!r} is not a Hugging Face model directory (no config.json)",
              file=sys.stderr)
        return 2
    if not _is_loopback(args.host) and args.api_key is None:
        logger.warning("serving on %s without --api-key: weight-update endpoints are disabled", args.host)

    import torch
    import torch.multiprocessing
    import uvicorn

    from megatron_flash.engines.cpu_engine import CpuEngine

    torch.set_num_threads(args.num_threads)
    # Tensors of /update_weights_from_tensor arrive as shared-memory files (file_descriptor crashes here).
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        engine = CpuEngine(model_path=args.model_path, num_blocks=args.num_blocks, page_size=args.page_size,
                           max_batch_tokens=args.max_batch_tokens, seed=args.seed)
    except Exception as error:
        print(f"error: cannot load model from {args.model_path!r}: {error}", file=sys.stderr)
        return 2
    app = build_app(engine, api_key=args.api_key, host=args.host)
    try:
        # A bounded graceful shutdown: requests still waiting on generation (or on a paused engine)
        # when SIGTERM arrives would otherwise keep the server alive forever after its trainer died.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=3)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
