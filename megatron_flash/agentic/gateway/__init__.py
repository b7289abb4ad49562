"""OpenAI-compatible gateway in front of the rollout engines, recording agent episodes token for token.

  requests.py      OpenAI request checks (errors name the field)
  tool_parsers.py  model text → content / tool_calls / reasoning_content (registry by name)
  trajectory.py    sessions: the exact prompt and sampled ids, masks, logprobs, versions
  core.py          one chat turn: render, prompt from the record, generate (resume on aborts), parse, record
  server.py        the HTTP routes (FastAPI)
  __main__.py      standalone: `python -m megatron_flash.agentic.gateway --engine-url URL --model-path DIR`
"""
