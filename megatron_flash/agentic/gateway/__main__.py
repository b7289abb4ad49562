"""Standalone gateway over running engines, for agent developers:

    python -m megatron_flash.agentic.gateway --engine-url http://127.0.0.1:30000 --model-path DIR --port 8000 \\
        [--api-key KEY] [--engine-api-key KEY] [--served-model-name NAME] [--tool-parser hermes]

Point any OpenAI-compatible client at http://127.0.0.1:8000/v1 (model = the served name, default the
model directory's name); GET /v1/trajectories/{session} returns what each session's engine consumed
and sampled. Binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-url", required=True, help="an SGLang-contract engine (SGLang, or the local engine server)")
    p.add_argument("--model-path", required=True, help="HF model directory: tokenizer and chat template")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` from agents")
    p.add_argument("--engine-api-key", default=None, help="the engine's API key")
    p.add_argument("--served-model-name", default=None, help="the `model` agents must send (default: the directory name)")
    p.add_argument("--tool-parser", default="hermes")
    p.add_argument("--default-max-tokens", type=int, default=1024, help="when a request sets no max_tokens")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import transformers
    import uvicorn

    from megatron_flash.agentic.gateway.core import GatewayCore
    from megatron_flash.agentic.gateway.server import build_app
    from megatron_flash.engines.client import EngineClient

    if not os.path.isdir(args.model_path):
        p.error(f"--model-path {args.model_path!r} is not a directory")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    client = EngineClient(args.engine_url, api_key=args.engine_api_key)
    try:
        core = GatewayCore(backend=client, tokenizer=tokenizer, model_name=name, tool_parser=args.tool_parser,
                           default_max_tokens=args.default_max_tokens)
    except ValueError as error:
        p.error(str(error))
    app = build_app(core, api_key=args.api_key)
    app.router.on_shutdown.append(client.close)  # its HTTP session lives on the server's event loop
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
