"""local engine server: SGLang 0.5.23's native HTTP API over `LocalEngine` (transformers continuous batching).

    python -m megatron_flash.engines.local_server --model-path runs/tiny_model --port 30000
    python -m megatron_flash.engines.local_server --model-path DIR --port N --host 0.0.0.0 --api-key KEY
    python -m megatron_flash.engines.local_server --model-path DIR --device cuda --dtype bfloat16   # on a GPU

Request and response JSON follow SGLang (see docs/engines.md for the fields and the few deviations), so
one client drives both. The routes (local_routes.py) are thin: parse, call the engine, shape SGLang's
response; /generate's parsing and replies are generate_request.py; this module builds the app, guards
it and runs it.

--decode-step-ms T (default 0: off) is a documented latency-injection option for benchmarks and the
cluster tests, not for production: every decode step lasts at least T ms whatever the number of running
sequences (1 … max_running), as a GPU's decode step costs about the same for all of them (on a CPU it
grows with them). After the step's real work the decoder thread sleeps the remainder, holding no lock,
then publishes the step's tokens; a pass that prefills new requests and decodes the running ones counts
as one step (engines/step_profile.py, StepFloor). /get_server_info reports it as `decode_step_ms`; the
slept seconds are `step_profile.floor_s`.

Security: with --api-key every endpoint but /health* and /ready needs `Authorization: Bearer KEY`
(401 otherwise, as SGLang). /update_weights_from_tensor unpickles its payload like SGLang does, through an
allowlist unpickler (tensors, torch shared-memory storages, containers; no code) — still, only expose it to
trusted peers: when bound to a non-loopback host without --api-key the weight-update endpoints answer 403.
"""

import argparse
import hmac
import ipaddress
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("megatron_flash.local_server")

_WEIGHT_ENDPOINTS = ("/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
                     "/update_weights_from_distributed", "/destroy_weights_update_group",
                     "/update_weights_from_shared_memory", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
                     "/unload_lora_adapter")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(engine: Any, *, api_key: str | None = None, host: str = "127.0.0.1") -> Any:
    """The FastAPI app serving `engine` (a `LocalEngine`): local_routes.py's routes behind the auth guard."""
    from fastapi import FastAPI

    from megatron_flash.engines import local_routes

    app = FastAPI()
    app.state.engine = engine
    app.include_router(local_routes.router)
    app.add_exception_handler(local_routes.BodyError, local_routes.on_body_error)
    app.add_middleware(Authorize, api_key=api_key,
                       weight_updates_exposed=api_key is not None or _is_loopback(host))
    return app


class Authorize:
    """The token check (SGLang's --api-key: `Authorization: Bearer KEY`) and the weight-endpoint guard
    as plain ASGI middleware: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) runs every
    request through an extra task and memory streams, which cost the engine's one event loop
    ~0.3 ms per request (benchmarks/engine_step_cost.py --loop-k; docs/benchmarks.md)."""

    def __init__(self, inner: Any, *, api_key: str | None, weight_updates_exposed: bool) -> None:
        self.inner, self.api_key, self.weight_updates_exposed = inner, api_key, weight_updates_exposed

    def refusal(self, scope: dict) -> Any:
        from fastapi.responses import JSONResponse

        path = scope["path"]
        if path.startswith(("/health", "/ready")):
            return None
        if self.api_key is not None:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        elif path in _WEIGHT_ENDPOINTS and not self.weight_updates_exposed:
            return JSONResponse({"error": f"{path} is disabled on a non-loopback host without --api-key"},
                                status_code=403)
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        denied = self.refusal(scope) if scope["type"] == "http" else None
        if denied is not None:
            await denied(scope, receive, send)
            return
        await self.inner(scope, receive, send)


def step_ms(text: str) -> float:
    """argparse type of --decode-step-ms: a finite number of milliseconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds (a number >= 0), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of milliseconds >= 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory (config.json, weights)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (as SGLang)")
    parser.add_argument("--decoder", default="static", choices=["static", "cb"],
                        help="static: slot KV cache, one decode step for all running requests (CUDA graphs on a "
                             "GPU); cb: transformers continuous batching (paged KV)")
    parser.add_argument("--num-blocks", type=int, default=64,
                        help="KV cache blocks (of --page-size tokens); static: --context-length defaults to "
                             "num_blocks x page_size")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="cb: tokens per forward step (256)")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="static: KV slots, i.e. requests decoded together (more wait at admission; 64)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="static: tokens per slot = the longest prompt + max_new_tokens a request may have")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="static: prompt tokens packed into one prefill forward (8192)")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="static on CUDA: decode eagerly instead of replaying captured steps")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling RNG")
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="torch device of the model and its KV cache: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype the model is served in (weight updates are cast to it)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (SGLang's /load_lora_adapter API; one at a time, merged: "
                             "engines/local_lora.py)")
    parser.add_argument("--decode-step-ms", type=step_ms, default=0.0, metavar="T",
                        help="latency injection for benchmarks and cluster tests, not production: every decode "
                             "step lasts at least T ms for 1 to max_running sequences, as on a GPU (0: off)")
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

    from megatron_flash.engines.local_engine import LocalEngine

    torch.set_num_threads(args.num_threads)
    # Tensors of /update_weights_from_tensor arrive as shared-memory files (file_descriptor crashes here).
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        engine = LocalEngine(model_path=args.model_path, decoder=args.decoder, num_blocks=args.num_blocks,
                             page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                             max_running_requests=args.max_running_requests, context_length=args.context_length,
                             max_prefill_tokens=args.max_prefill_tokens, cuda_graphs=not args.disable_cuda_graph,
                             seed=args.seed, device=args.device, dtype=args.dtype, enable_lora=args.enable_lora,
                             decode_step_ms=args.decode_step_ms)
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
