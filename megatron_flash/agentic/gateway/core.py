"""One chat turn of an agent session: render → prompt from the record → generate → parse → record.

The backend is anything with SGLang-contract generation, `generate(input_ids, sampling_params, *,
rid) -> GenerateResult`: an `EngineClient` (standalone gateway) or the run's `LLMProxy` (queue
scheduling, retries, pause modes). A turn that the engine cuts at a weight push (pause mode abort)
continues from its prefix under the new weights, as rollout samples do; per-token versions record
which weights sampled each token.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, Callable, Optional

from megatron_flash.agentic.gateway.requests import ChatRequest, RequestError
from megatron_flash.agentic.gateway.tool_parsers import ParsedOutput, get_tool_parser
from megatron_flash.agentic.gateway.trajectory import Session, SessionStore, normalise
from megatron_flash.counters import Counters
from megatron_flash.engines.client import version_number

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GatewayStats(Counters):
    requests: int = 0
    request_errors: int = 0
    engine_errors: int = 0
    retokenize_mismatches: int = 0
    history_rewrites: int = 0
    tool_parse_failures: int = 0
    resumes: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass
class TurnResult:
    completion_id: str
    created: int
    parsed: ParsedOutput
    finish_reason: str  # OpenAI's: stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int


def token_versions(result: Any) -> list[Optional[int]]:
    """Per output token, the policy version that sampled it (the engine's spans, else its version)."""
    spans = result.span_versions()
    return spans if spans is not None else [version_number(result.weight_version)] * len(result.output_ids)


class GatewayCore:
    def __init__(self, *, backend: Any, tokenizer: Any, model_name: str, tool_parser: str = "hermes",
                 default_max_tokens: int = 1024, max_resumes: int = 16, sessions: Optional[SessionStore] = None,
                 any_model: bool = False) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {model_name!r} has no chat template: the gateway renders messages with it")
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.any_model = any_model  # serve every `model` name (in a run: agents keep their own names)
        self.parser = get_tool_parser(tool_parser)
        self.default_max_tokens, self.max_resumes = default_max_tokens, max_resumes
        self.sessions = sessions or SessionStore()
        self.stats = GatewayStats()
        self.closed_sessions: Optional[set[str]] = None  # in a run: ended episodes, refused from then on

    def renderer(self, request: ChatRequest) -> Callable[[list[dict]], str]:
        def render(messages: list[dict]) -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, tools=request.tools, add_generation_prompt=True,
                                                          tokenize=False)
            except Exception as error:  # a template that rejects this conversation (roles, tool messages)
                raise RequestError(f"the model's chat template cannot render these messages: {error}",
                                   param="messages") from None
        return render

    async def chat(self, request: ChatRequest, session_id: str) -> TurnResult:
        session = self.sessions.open(session_id)
        async with session.lock:
            return await self._turn(request, session)

    async def _turn(self, request: ChatRequest, session: Session) -> TurnResult:
        from megatron_flash.engines.client import EngineHTTPError

        self.stats.requests += 1
        plan = session.plan(request.messages, self.renderer(request), self.tokenizer)
        prompt = session.prompt_ids(plan)
        budget = request.sampling["max_new_tokens"]
        output: list[int] = []
        logprobs: list[float] = []
        versions: list[Optional[int]] = []
        resumes, finish = 0, "abort"
        base_rid = f"gw-{session.session_id}-{len(session.turns)}-{uuid.uuid4().hex[:8]}"
        try:
            while True:
                params = {**request.sampling, "max_new_tokens": budget - len(output)}
                session.current_rid = f"{base_rid}-r{resumes}"
                result = await self.backend.generate(prompt + output, params, rid=session.current_rid)
                output += list(result.output_ids)
                logprobs += list(result.output_logprobs or [0.0] * len(result.output_ids))
                versions += token_versions(result)
                if not result.aborted:
                    finish = result.finish_reason
                    break
                resumes += 1
                self.stats.resumes += 1
                if resumes > self.max_resumes or len(output) >= budget:
                    raise RequestError(f"generation was aborted {resumes} times (weight pushes) without finishing",
                                       status=503, err_type="server_error")
        except EngineHTTPError as error:
            self.stats.engine_errors += 1
            if 400 <= error.status < 500:  # the engine refused this request (too long, a sampling field)
                raise RequestError(f"the engine refused the request: {error.body[:500]}") from None
            raise RequestError(f"engine error: {error}", status=502, err_type="server_error") from None
        except RequestError:
            raise
        except Exception as error:  # engines down, deadlines: the agent may retry
            self.stats.engine_errors += 1
            raise RequestError(f"no engine could serve the request: {type(error).__name__}: {error}", status=503,
                               err_type="server_error") from None
        parsed = self.parser.parse(self.tokenizer.decode(output, skip_special_tokens=True),
                                   tools_offered=bool(request.tools))
        session.current_rid = None
        session.record(plan, output, logprobs, versions, finish, resumes,
                       reply=normalise(parsed.content, parsed.tool_calls))
        self.stats.retokenize_mismatches += plan.retokenized
        self.stats.history_rewrites += plan.rewrite
        self.stats.prompt_tokens += len(prompt)
        self.stats.completion_tokens += len(output)
        if parsed.parse_error:
            self.stats.tool_parse_failures += 1
            logger.debug("session %s: tool-call markup left as text (%s)", session.session_id, parsed.parse_error)
        reason = "tool_calls" if parsed.tool_calls else ("length" if finish == "length" else "stop")
        return TurnResult(completion_id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), parsed=parsed,
                          finish_reason=reason, prompt_tokens=len(prompt), completion_tokens=len(output))
