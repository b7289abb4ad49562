"""The local engine server's routes (SGLang 0.5.23's native API), one small function each, over the
`LocalEngine` in `request.app.state.engine`. Replies take SGLang's shapes: `{"success", "message"}` for
weight and control calls, `{"error": {"message"}}` (400) for a bad /generate, FastAPI's validation
shape (400) for a body that is not a JSON object or lacks a required field.
"""

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from megatron_flash.engines import generate_request as gen

router = APIRouter()


class BodyError(Exception):
    """A request body that is not a JSON object, or lacks a required field."""


def bad_request(message: str) -> JSONResponse:
    # SGLang's shape for a body FastAPI cannot validate (its RequestValidationError handler).
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None,
                         "code": 400}, status_code=400)


async def on_body_error(request: Request, error: BodyError) -> JSONResponse:
    return bad_request(str(error))


def value_error(error: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": str(error)}}, status_code=400)  # SGLang _create_error_response


def outcome(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


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


def engine_of(request: Request) -> Any:
    return request.app.state.engine


# ---------------------------------------------------------------- status
@router.get("/health")
@router.get("/health_generate")
@router.get("/ready")
async def health(request: Request) -> Response:
    return Response(status_code=200 if engine_of(request).healthy() else 503)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    from megatron_flash.engines.local_engine import model_summary

    return model_summary(engine_of(request))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    engine = engine_of(request)
    return {"model_path": engine.model_path, "context_length": engine.capacity,
            "max_total_num_tokens": engine._kv_capacity, "page_size": engine.page_size,
            "max_batch_tokens": engine.max_batch_tokens, "decoder": engine.decoder,
            "decode_step_ms": engine.decode_step_ms,  # --decode-step-ms: latency injection, 0 = off
            "max_running_requests": engine._kv_capacity // engine.page_size if engine.decoder == "static" else None, "weight_version": engine.weight_version,
            "version": "megatron-flash-cpu", "internal_states": [],
            "memory_released": sorted(engine._released), "memory_releases": engine.num_releases,
            "num_live_requests": len(engine._live),
            "weight_update_shared_memory": True,  # /update_weights_from_shared_memory (staged ipc)
            "weight_update_delta": True,  # delta pushes with checksums (engines/weight_delta.py)
            "weight_update_delta_counts": dict(getattr(engine, "delta_counts", {})),
            "enable_lora": engine.lora_enabled, "loaded_adapters": engine.loaded_adapters(),
            "device": str(engine.device), "device_uuid": engine.device_uuid,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "step_profile": engine.step_profile.snapshot(), **engine.memory_bytes()}


# ---------------------------------------------------------------- generation
@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request)
    try:
        items = gen.parse_generate(engine, body)
    except (ValueError, TypeError) as error:
        return value_error(error)
    single = len(items) == 1 and gen.is_single(body)
    if body.get("stream"):
        if not single:
            return value_error(ValueError("stream=true is supported for a single prompt only"))
        return StreamingResponse(gen.stream_one(engine, items[0]), media_type="text/event-stream")
    try:
        outs = await asyncio.gather(*(gen.run_one(engine, item) for item in items))
    except ValueError as error:
        return value_error(error)
    return JSONResponse(outs[0] if single else list(outs))


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await body_of(request)
    engine_of(request).abort(rid=str(body.get("rid") or ""), abort_all=bool(body.get("abort_all", False)))
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Any:
    body = await body_of(request)
    try:
        await engine_of(request).pause(body.get("mode", "abort"))
    except ValueError as error:
        return bad_request(str(error))
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Any:
    await body_of(request)
    await engine_of(request).resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    # No prefix cache is kept (block sharing off), so a flush only has to refuse while requests hold KV.
    if engine_of(request).holds_kv():
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


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> Any:
    return await memory_call(request, engine_of(request).release_memory)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> Any:
    return await memory_call(request, engine_of(request).resume_memory)


# ---------------------------------------------------------------- weights
@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict:
    return {"weight_version": engine_of(request).weight_version}


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "new_version")
    verify = body.get("verify_tensors")
    if verify is not None and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
        return bad_request(f"verify_tensors must be an integer >= 0, got {verify!r}")
    problem = engine.finish_delta(verify)  # a delta push's checksums (engines/weight_delta.py)
    if problem:
        return outcome(False, f"weight version not updated: {problem}")
    if body.get("abort_all_requests", True):
        engine.abort(abort_all=True)
    engine._set_version(str(body["new_version"]))
    return JSONResponse({"success": True, "message": f"Weight version updated to {body['new_version']}",
                         "new_version": body["new_version"]})


async def weight_update(engine: Any, body: dict, load: Any) -> tuple[bool, str]:
    """Run `load` as one weight update with the body's version / flush / abort options."""
    return await engine.run_weight_update(load, weight_version=body.get("weight_version"),
                                          flush_cache=body.get("flush_cache", True),
                                          abort_all_requests=body.get("abort_all_requests", False))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "model_path")
    path, load_format, verify = str(body["model_path"]), body.get("load_format"), body.get("verify_tensors")
    if verify is not None and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
        return bad_request(f"verify_tensors must be an integer >= 0, got {verify!r}")
    success, message = await weight_update(engine, body, lambda: engine.load_from_disk(path, load_format, verify))
    return outcome(success, message, num_paused_requests=0)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request) -> Any:
    """SGLang's: the first `truncate_size` values (flattened here) of a served tensor by HF name; with
    `checksum: true` also engines/weight_delta.checksum of its bytes (not in SGLang)."""
    from megatron_flash.engines.local_engine_updates import checkpoint_param
    from megatron_flash.engines.weight_delta import checksum

    engine, body = engine_of(request), await body_of(request, "name")
    tensor = checkpoint_param(engine.model.state_dict(keep_vars=True), str(body["name"]))
    if tensor is None:
        return value_error(ValueError(f"unknown parameter {body['name']!r}"))
    size = body.get("truncate_size", 100)
    engine._ensure_loop_state()
    async with engine._update_lock:
        flat = tensor.detach().reshape(-1)[:size].float().cpu().tolist()
        out: dict = {"name": body["name"], "shape": list(tensor.shape), "values": flat,
                     "dtype": str(tensor.dtype).removeprefix("torch.")}
        if body.get("checksum"):
            out["checksum"] = checksum(tensor).cpu().tolist()
    return out


@router.post("/begin_weight_update")
async def begin_weight_update(request: Request) -> Any:
    await body_of(request)
    return outcome(*engine_of(request).begin_session())


@router.post("/end_weight_update")
async def end_weight_update(request: Request) -> Any:
    await body_of(request)
    return outcome(*engine_of(request).end_session())


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "serialized_named_tensors")
    payloads = body["serialized_named_tensors"]
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return bad_request("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    try:
        engine.require_session("update_weights_from_tensor")
    except ValueError as error:
        return outcome(False, str(error))
    load_format = body.get("load_format")
    return outcome(*await weight_update(engine, body, lambda: engine.load_from_tensor_payload(payloads[0], load_format)))


@router.post("/update_weights_from_shared_memory")
async def update_weights_from_shared_memory(request: Request) -> Any:
    """Not in SGLang: the bridge's staged ipc (engines/shared_weights.py); advertised in /get_server_info."""
    engine, body = engine_of(request), await body_of(request, "buffer", "tensors")
    try:
        engine.require_session("update_weights_from_shared_memory")
    except ValueError as error:
        return outcome(False, str(error))
    return outcome(*await weight_update(engine, body, lambda: engine.load_from_shared_memory(body)))


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Any:
    engine = engine_of(request)
    body = await body_of(request, "master_address", "master_port", "rank_offset", "world_size")
    try:
        message = await asyncio.to_thread(
            engine.init_group, master_address=str(body["master_address"]), master_port=int(body["master_port"]),
            rank_offset=int(body["rank_offset"]), world_size=int(body["world_size"]),
            group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"))
    except Exception as error:
        return outcome(False, f"Failed to initialize custom process group: {error}.")
    return outcome(True, message)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Any:
    body = await body_of(request)
    try:
        return outcome(True, engine_of(request).destroy_group(body.get("group_name", "weight_update_group")))
    except Exception as error:
        return outcome(False, str(error))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "names", "dtypes", "shapes")
    try:
        engine.require_session("update_weights_from_distributed")
    except ValueError as error:
        return outcome(False, str(error))
    kwargs = {"names": list(body["names"]), "dtypes": list(body["dtypes"]), "shapes": list(body["shapes"]),
              "group_name": body.get("group_name", "weight_update_group"), "load_format": body.get("load_format")}
    return outcome(*await weight_update(engine, body, lambda: engine.receive_broadcast(**kwargs)))


# ---------------------------------------------------------------- LoRA adapters (engines/local_lora.py)
def lora_outcome(engine: Any, success: bool, message: str) -> JSONResponse:
    # SGLang's LoRAUpdateOutput shape
    return JSONResponse({"success": success, "error_message": "" if success else message, "message": message,
                         "loaded_adapters": engine.loaded_adapters()}, status_code=200 if success else 400)


async def lora_update(engine: Any, name: Any, load: Any) -> JSONResponse:
    try:
        engine.check_new_adapter(name)
    except ValueError as error:
        return lora_outcome(engine, False, str(error))
    return lora_outcome(engine, *await engine.run_weight_update(load, weight_version=None, flush_cache=False))


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "lora_name", "lora_path")
    path = str(body["lora_path"])

    def load() -> str:
        from megatron_flash.engines.weight_payloads import read_peft_folder

        config, named = read_peft_folder(path)
        return engine.merge_adapter(str(body["lora_name"]), config, named)
    return await lora_update(engine, body["lora_name"], load)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request) -> Any:
    engine = engine_of(request)
    body = await body_of(request, "lora_name", "config_dict", "serialized_named_tensors")
    payloads, config = body["serialized_named_tensors"], body["config_dict"]
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        return bad_request("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    if not isinstance(config, dict):
        return bad_request("config_dict must be a JSON object (PEFT's adapter_config)")

    def load() -> str:
        from megatron_flash.engines.weight_payloads import read_tensor_payload

        named = read_tensor_payload(payloads[0], body.get("load_format"))
        return engine.merge_adapter(str(body["lora_name"]), config, named)
    return await lora_update(engine, body["lora_name"], load)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Any:
    engine, body = engine_of(request), await body_of(request, "lora_name")
    try:
        engine._require_lora()
        if body["lora_name"] != engine._lora_current:  # a name only: no weight changes, nothing to wait for
            return lora_outcome(engine, True, engine.unload_adapter(body["lora_name"]))
    except ValueError as error:
        return lora_outcome(engine, False, str(error))
    return lora_outcome(engine, *await engine.run_weight_update(lambda: engine.unload_adapter(body["lora_name"]),
                                                                weight_version=None, flush_cache=False))
