"""The agent gateway's pure pieces: OpenAI request checks, the Hermes tool-call parser, and the
session record (prompt from recorded tokens, re-tokenisation, rewrites, atomic turns)."""

from __future__ import annotations

import json

import pytest

from megatron_flash.agentic.gateway.requests import RequestError, parse_chat_request
from megatron_flash.agentic.gateway.tool_parsers import get_tool_parser
from megatron_flash.agentic.gateway.trajectory import Session, normalise

USER = [{"role": "user", "content": "hi"}]


def parse(**body):
    return parse_chat_request({"model": "m", "messages": USER, **body}, served_model="m", default_max_tokens=64)


def test_sampling_fields_map_to_sglang_names() -> None:
    r = parse(temperature=0.5, top_p=0.9, max_completion_tokens=7, stop="x", seed=3, presence_penalty=0.1,
              stream=True, stream_options={"include_usage": True}, parallel_tool_calls=False, user="ep")
    assert r.sampling == {"temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.1, "max_new_tokens": 7,
                          "stop": ["x"], "sampling_seed": 3}
    assert r.stream and r.include_usage and r.user == "ep"
    assert parse().sampling == {"max_new_tokens": 64}


@pytest.mark.parametrize("body,param,status", [
    ({"model": "other"}, "model", 404),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", 400),
    ({"messages": [{"role": "user"}]}, "messages[0].content", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", 400),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id", 400),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", 400),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", 400),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", 400),
    ({"tools": {"name": "f"}}, "tools", 400),
    ({"tool_choice": "required"}, "tool_choice", 400),
    ({"n": 2}, "n", 400),
    ({"temperature": 3}, "temperature", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"frobnicate": 1}, "frobnicate", 400),
])
def test_bad_requests_name_the_field(body, param, status) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat_request({"model": "m", "messages": USER, **body}, served_model="m", default_max_tokens=64)
    assert err.value.param == param and err.value.status == status
    assert err.value.body()["error"]["param"] == param


def test_tool_choice_none_hides_the_tools_and_sent_calls_become_mappings() -> None:
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert parse(tools=tools, tool_choice="none").tools is None
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    r = parse(messages=msgs, tools=tools)
    assert r.messages[1]["tool_calls"][0]["function"]["arguments"] == {"e": "1+1"}
    assert r.messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}


def test_hermes_parser_calls_content_reasoning_and_failures() -> None:
    p = get_tool_parser("hermes")
    out = p.parse('<think>add them</think>Let me compute.<tool_call>{"name": "calc", "arguments": {"e": "2+3"}}'
                  '</tool_call>', tools_offered=True)
    assert out.reasoning == "add them" and out.content == "Let me compute."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == \
        [("calc", {"e": "2+3"})]
    assert out.tool_calls[0]["id"].startswith("call_")
    two = p.parse('<tool_call>{"name": "a", "arguments": "{}"}</tool_call><tool_call>{"name": "b"}</tool_call>',
                  tools_offered=True)
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"] and two.content is None
    bad = p.parse('<tool_call>{"name": 5}</tool_call>', tools_offered=True)
    assert bad.tool_calls == [] and bad.content == '<tool_call>{"name": 5}</tool_call>' and "tool call 0" in bad.parse_error
    assert p.parse('<tool_call>{"name": "a"}', tools_offered=True).parse_error == "an unclosed <tool_call> block"
    assert p.parse('<tool_call>{"name": "a"}</tool_call>', tools_offered=False).tool_calls == []
    with pytest.raises(ValueError, match="unknown tool parser 'x'; known: hermes"):
        get_tool_parser("x")


class CharTokenizer:
    """One token per character, except the pair 'ab', which encodes as one token (id 1000): a
    tokenizer whose encode of a text can differ from the tokens a model sampled for it."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(1000)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("ab" if t == 1000 else chr(t) for t in ids)


def render(messages: list[dict]) -> str:
    """A toy chat template: 'u:text|' per message (first letter of the role), then 'a:'."""
    return "".join(f"{m['role'][0]}:{m['content']}|" for m in messages) + "a:"


def turn(session: Session, tok: CharTokenizer, messages: list[dict], sampled: str, version: int = 0):
    plan = session.plan(messages, render, tok)
    prompt = session.prompt_ids(plan)
    out = [ord(c) for c in sampled]  # the engine samples characters one by one, never the merged token
    session.record(plan, out, [-0.5] * len(out), [version] * len(out), "stop", reply=normalise(sampled, None))
    return prompt, plan


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_record_extends_with_the_engines_tokens_and_masks_only_them() -> None:
    tok, s = CharTokenizer(), Session("e")
    turn(s, tok, [user("hi")], "xy")
    prompt, plan = turn(s, tok, [user("hi"), reply("xy"), user("more")], "z", version=1)
    assert not plan.retokenized and prompt == tok.encode("u:hi|a:xy|u:more|a:")
    fields = s.sample_fields()
    assert fields["prompt_ids"] == tok.encode("u:hi|a:")
    assert tok.decode(fields["response_ids"]) == "xy|u:more|a:z"
    assert fields["response_mask"] == [1, 1] + [0] * len("|u:more|a:") + [1]
    assert fields["token_versions"][-1] == 1 and fields["behavior_logprobs"][0] == -0.5


def test_retokenised_history_keeps_the_sampled_tokens() -> None:
    tok, s = CharTokenizer(), Session("e")
    turn(s, tok, [user("")], "ab")  # sampled 'a','b'; encode("ab") would be the merged token
    sampled = list(s.ids)
    prompt, plan = turn(s, tok, [user(""), reply("ab"), user("x")], "c")
    assert plan.retokenized and not plan.rewrite and s.retokenize_mismatches == 1
    assert prompt[:len(sampled)] == sampled and 1000 not in s.ids  # the engine's 'a','b', not the merged id
    assert tok.decode(prompt) == "u:|a:ab|u:x|a:"


def test_a_template_that_re_renders_earlier_replies_differently_keeps_the_record() -> None:
    """Like Qwen3's template dropping earlier reasoning: the reply renders as other text."""
    tok, s = CharTokenizer(), Session("e")

    def strip_think(messages: list[dict]) -> str:
        return render([{**m, "content": m["content"].split("]")[-1]} if m["role"] == "assistant" else m
                       for m in messages])
    s.record(s.plan([user("q")], strip_think, tok), [ord(c) for c in "[t]x"], [-1.0] * 4, [0] * 4, "stop",
             reply=normalise("[t]x", None))
    plan = s.plan([user("q"), reply("[t]x"), user("r")], strip_think, tok)
    assert not plan.rewrite and plan.retokenized  # a full re-render would have lost "[t]"
    assert tok.decode(s.prompt_ids(plan)) == "u:q|a:[t]x|u:r|a:"


def test_rewritten_history_cuts_the_record_at_the_common_prefix() -> None:
    tok, s = CharTokenizer(), Session("e")
    turn(s, tok, [user("q")], "xyz")
    prompt, plan = turn(s, tok, [user("q"), reply("xw"), user("r")], "k")
    assert plan.rewrite and s.history_rewrites == 1
    assert tok.decode(s.ids) == "u:q|a:xw|u:r|a:k"
    assert s.mask[len("u:q|a:")] == 1 and s.mask[len("u:q|a:x")] == 0  # 'w' is the agent's, not sampled


def test_a_failed_turn_leaves_the_session_unchanged() -> None:
    tok, s = CharTokenizer(), Session("e")
    turn(s, tok, [user("q")], "x")
    before = s.to_json()
    s.plan([user("q"), reply("x"), user("again")], render, tok)  # then the engine fails: no record()
    assert s.to_json() == before


def test_config_knows_every_registered_tool_parser() -> None:
    from megatron_flash.agentic.gateway.tool_parsers import TOOL_PARSERS
    from megatron_flash.config.schema import TOOL_PARSER_NAMES

    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)


def test_workflow_config_rules_name_the_field() -> None:
    from megatron_flash.config import load_config

    cfg = load_config(None, ["agentic.workflow=examples.agents.calculator:run"])
    assert cfg.agentic.workflow == "examples.agents.calculator:run"
    with pytest.raises(ValueError, match="agentic.workflow .*exclusive"):
        load_config(None, ["agentic.workflow=a:b", "agentic.env=calculator", "agentic.max_episode_tokens=64",
                           "trainer.max_seq_len=128"])
    with pytest.raises(ValueError, match="agentic.max_turns is used by agentic.env episodes only"):
        load_config(None, ["agentic.workflow=a:b", "agentic.max_turns=3"])
    with pytest.raises(ValueError, match="agentic.gateway_tool_parser"):
        load_config(None, ["agentic.workflow=a:b", "agentic.gateway_tool_parser=xml"])
    with pytest.raises(ValueError, match="agentic.workflow"):
        load_config(None, ["agentic.workflow=no_colon"])
    with pytest.raises(ValueError, match="agentic.workflow_timeout_s is used with agentic.workflow only"):
        load_config(None, ["agentic.workflow_timeout_s=5"])
