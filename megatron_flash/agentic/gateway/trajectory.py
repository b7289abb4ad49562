"""Token-in/token-out trajectories of agent sessions: what the engine consumed and sampled, exactly.

A session is one agent episode. Its record is one growing token sequence with, per token, whether the
engine sampled it (mask 1: trained) or it came from the prompt side (mask 0: system/user text, tool
outputs, the chat template's own tokens), the behaviour logprob of sampled tokens and the policy
version that sampled them. Each request's prompt is built from that record, never by re-tokenising
text the engine produced:

  * the agent's history, rendered by the chat template, extends the record token for token (the
    usual case: the template renders an earlier reply as the very tokens the engine sampled): the
    new tokens are appended as prompt tokens;
  * otherwise the rendering re-tokenised something (`retokenize_mismatches` += 1). If its text still
    starts with the record's text, the record is kept and only the new text is tokenised after it;
    if the agent rewrote its history, the record is cut at the longest common token prefix
    (`history_rewrites` += 1: sampled tokens after the cut are no longer part of the episode).

`sample_fields()` is the episode as one training sample: prompt = the tokens before the first
sampled token, response = the rest with its mask.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Callable, Optional

PLACEHOLDER = "MFGWREPLY7Q"  # stands for the last reply when rendering; survives any template as plain text


@dataclasses.dataclass(frozen=True)
class PromptPlan:
    keep: int  # tokens of the record kept (all of it unless the agent rewrote its history)
    new_ids: list[int]  # prompt tokens after them
    retokenized: bool
    rewrite: bool


@dataclasses.dataclass
class Turn:
    prompt_len: int  # tokens of the record sent as this turn's prompt
    output_ids: list[int]
    logprobs: list[float]
    versions: list[Optional[int]]
    finish_reason: str
    retokenized: bool
    num_resumes: int = 0
    reply: Any = None  # the assistant message returned for this turn, normalised (see `normalise`)


def normalise(content: Optional[str], tool_calls: Any) -> tuple:
    """An assistant message as compared between what the gateway returned and what the agent sends
    back: stripped content (empty = none) and (name, arguments) of each call, arguments as canonical JSON."""
    calls = []
    for call in tool_calls or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return ((content or "").strip() or None, tuple(calls))


class Session:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[Optional[int]] = []
        self.turns: list[Turn] = []
        self.retokenize_mismatches = 0
        self.history_rewrites = 0
        self.lock = asyncio.Lock()  # one request of a session at a time
        self.current_rid: Optional[str] = None  # the engine request in flight (aborted if the episode is cancelled)
        self.created = self.touched = time.time()

    def plan(self, messages: list[dict], render: Callable[[list[dict]], str], tokenizer: Any) -> "PromptPlan":
        """This turn's prompt from the record and the agent's messages (nothing changes until
        `record`: a failed request leaves the session as it was). `render(messages)` is the chat
        template's text with the generation prompt."""
        text = render(messages)
        rendered_ids = tokenizer.encode(text, add_special_tokens=False)
        n = len(self.ids)
        extends = rendered_ids[:n] == self.ids
        last = self.turns[-1] if self.turns else None
        at = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is not None and at is not None and \
                normalise(messages[at].get("content"), messages[at].get("tool_calls")) == last.reply:
            held = render(messages[:at] + [{"role": "assistant", "content": PLACEHOLDER}] + messages[at + 1:])
            if held.count(PLACEHOLDER) == 1:
                after = held.split(PLACEHOLDER, 1)[1]
                if last.finish_reason == "stop" and last.output_ids:
                    # The reply ended with a stop token the engine sampled (the template's end of
                    # message, usually): it is in the record already.
                    stop_text = tokenizer.decode(last.output_ids[-1:], skip_special_tokens=False)
                    if stop_text and after.startswith(stop_text):
                        after = after[len(stop_text):]
                new = tokenizer.encode(after, add_special_tokens=False)
                return PromptPlan(keep=n, new_ids=new, retokenized=not extends, rewrite=False)
        if extends:
            return PromptPlan(keep=n, new_ids=rendered_ids[n:], retokenized=False, rewrite=False)
        recorded_text = tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.startswith(recorded_text):
            new = tokenizer.encode(text[len(recorded_text):], add_special_tokens=False)
            return PromptPlan(keep=n, new_ids=new, retokenized=True, rewrite=False)
        keep = 0
        while keep < min(n, len(rendered_ids)) and rendered_ids[keep] == self.ids[keep]:
            keep += 1
        return PromptPlan(keep=keep, new_ids=rendered_ids[keep:], retokenized=True, rewrite=True)

    def prompt_ids(self, plan: "PromptPlan") -> list[int]:
        return self.ids[:plan.keep] + plan.new_ids

    def record(self, plan: "PromptPlan", output_ids: list[int], logprobs: list[float],
               versions: list[Optional[int]], finish_reason: str, num_resumes: int = 0, reply: Any = None) -> None:
        """Commit a finished turn: the prompt's new tokens (mask 0), then the sampled ones (mask 1)."""
        self.retokenize_mismatches += plan.retokenized
        self.history_rewrites += plan.rewrite
        self.ids, self.mask = self.ids[:plan.keep], self.mask[:plan.keep]
        self.logprobs, self.versions = self.logprobs[:plan.keep], self.versions[:plan.keep]
        k = len(plan.new_ids)
        self.ids += plan.new_ids + list(output_ids)
        self.mask += [0] * k + [1] * len(output_ids)
        self.logprobs += [0.0] * k + list(logprobs)
        self.versions += [None] * k + list(versions)
        self.turns.append(Turn(prompt_len=plan.keep + k, output_ids=list(output_ids), logprobs=list(logprobs),
                               versions=list(versions), finish_reason=finish_reason, retokenized=plan.retokenized,
                               num_resumes=num_resumes, reply=reply))
        self.touched = time.time()

    def sample_fields(self) -> Optional[dict]:
        """prompt_ids / response_ids / behavior_logprobs / response_mask / token_versions of the
        episode, or None when the engine sampled nothing in it."""
        if 1 not in self.mask:
            return None
        start = self.mask.index(1)
        return {"prompt_ids": self.ids[:start], "response_ids": self.ids[start:],
                "behavior_logprobs": self.logprobs[start:], "response_mask": self.mask[start:],
                "token_versions": self.versions[start:]}

    def to_json(self) -> dict:
        return {"session": self.session_id, "token_ids": self.ids, "mask": self.mask, "logprobs": self.logprobs,
                "versions": self.versions, "retokenize_mismatches": self.retokenize_mismatches,
                "history_rewrites": self.history_rewrites,
                "turns": [{k: v for k, v in dataclasses.asdict(t).items() if k != "reply"} for t in self.turns]}


class SessionStore:
    """Sessions by id; the oldest untouched ones are dropped past `max_sessions` (standalone gateways
    serve agents that never say they are done)."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def get(self, session_id: str) -> Optional[Session]:
        return self._sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                oldest = min(self._sessions.values(), key=lambda s: s.touched)
                del self._sessions[oldest.session_id]
            session = self._sessions[session_id] = Session(session_id)
        return session

    def pop(self, session_id: str) -> Optional[Session]:
        return self._sessions.pop(session_id, None)
