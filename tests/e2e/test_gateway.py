"""The agent gateway with the official `openai` client: `python -m megatron_flash.agentic.gateway`
(standalone mode, a subprocess) over a real local engine server serving the tiny chat model.

Checked against independent computations: each recorded turn's tokens and logprobs equal what the
engine itself samples for that prompt (greedy, asked directly over EngineClient); the trajectory's
mask is 1 exactly on those tokens; a reply whose text encodes to other tokens than the engine
sampled is counted as a re-tokenisation and the record keeps the engine's tokens; streaming gives
the non-streamed reply; a weight push in the middle of a turn (pause modes abort and in_place)
records both versions; bad input gets OpenAI-style errors naming the field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request

import httpx
import openai
import pytest

from megatron_flash.engines.client import EngineClient
from megatron_flash.ports import free_ports
from tests.conftest import REPO, run_tool
from tests.contract.conftest import launch_engine

KEY = "gw-test-key"
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chat_models")
    out = {}
    for seed in (0, 1):
        out[seed] = str(root / f"chat{seed}")
        run_tool(["tools/make_tiny_model.py", "--out", out[seed], "--chat", "--seed", str(seed)])
    return out


@pytest.fixture(scope="module")
def stack(chat_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway_logs")
    engine = launch_engine("cpu", chat_models[0], str(logs))
    asyncio.run(_call(engine.url, lambda c: c.update_weight_version("0")))
    port = free_ports(1)
    log = open(os.path.join(logs, "gateway.log"), "w")
    gateway = subprocess.Popen([sys.executable, "-m", "megatron_flash.agentic.gateway", "--engine-url", engine.url,
                                "--model-path", chat_models[0], "--port", str(port), "--api-key", KEY,
                                "--served-model-name", "tiny-chat", "--log-level", "warning"],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(open(os.path.join(logs, "gateway.log")).read())
            time.sleep(0.25)
    yield {"engine": engine, "url": url, "client": openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)}
    gateway.terminate()
    gateway.wait(20)
    engine.stop()


async def _call(url: str, fn):
    async with EngineClient(url) as client:
        return await fn(client)


def _live(engine_url: str) -> int:
    with urllib.request.urlopen(engine_url + "/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())["num_live_requests"]


def _steps(engine_url: str) -> int:
    """Generation steps the local engine has run (its step_profile): a live request may not have a token yet."""
    with urllib.request.urlopen(engine_url + "/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())["step_profile"]["steps"]


def trajectory(stack, session: str) -> dict:
    r = httpx.get(f"{stack['url']}/v1/trajectories/{session}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def chat(stack, session: str, messages: list, **kwargs):
    return stack["client"].chat.completions.create(model="tiny-chat", messages=messages,
                                                   extra_headers={"X-Session-Id": session}, **kwargs)


def test_models_and_a_plain_chat(stack) -> None:
    assert [m.id for m in stack["client"].models.list().data] == ["tiny-chat"]
    r = chat(stack, "plain", [{"role": "user", "content": "what is 2+3?"}], max_tokens=6, temperature=0)
    t = trajectory(stack, "plain")
    assert r.usage.completion_tokens == len(t["turns"][0]["output_ids"]) and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == t["turns"][0]["prompt_len"]


def test_multi_turn_records_exactly_the_engines_tokens(stack) -> None:
    messages = [{"role": "system", "content": "you add numbers"}, {"role": "user", "content": "what is 12+7?"}]
    for step in range(3):
        r = chat(stack, "multi", messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"and plus {step}?"}]
    t = trajectory(stack, "multi")
    ids, mask = t["token_ids"], t["mask"]
    assert len(t["turns"]) == 3 and t["history_rewrites"] == 0
    sampled_positions = set()
    for turn in t["turns"]:
        prompt = ids[:turn["prompt_len"]]
        direct = asyncio.run(_call(stack["engine"].url, lambda c: c.generate(
            prompt, {"max_new_tokens": 8, "temperature": 0.0})))
        assert turn["output_ids"] == direct.output_ids  # what the engine samples for exactly this prompt
        assert turn["logprobs"] == pytest.approx(direct.output_logprobs, abs=1e-5)
        n = turn["prompt_len"]
        assert ids[n:n + len(turn["output_ids"])] == turn["output_ids"]
        sampled_positions |= set(range(n, n + len(turn["output_ids"])))
    assert {i for i, m in enumerate(mask) if m == 1} == sampled_positions


def test_text_that_re_encodes_differently_keeps_the_engines_tokens(stack, chat_models) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(chat_models[0])
    for seed in range(40):  # sampled outputs until one whose text BPE-encodes to other tokens
        session = f"retok{seed}"
        messages = [{"role": "user", "content": "what is 12+7?"}]
        r = chat(stack, session, messages, max_tokens=12, temperature=1.0, seed=seed)
        out = trajectory(stack, session)["turns"][0]["output_ids"]
        body = out[:-1] if out and out[-1] == tok.eos_token_id else out
        if tok.encode(tok.decode(body), add_special_tokens=False) != body:
            break
    else:
        pytest.fail("no sampled reply re-encoded differently in 40 tries")
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "ok"}]
    chat(stack, session, messages, max_tokens=4, temperature=0)
    t = trajectory(stack, session)
    assert t["retokenize_mismatches"] == 1 and t["history_rewrites"] == 0
    n = t["turns"][0]["prompt_len"]
    assert t["token_ids"][n:n + len(out)] == out and t["mask"][n:n + len(out)] == [1] * len(out)


def test_streaming_gives_the_same_reply(stack) -> None:
    messages = [{"role": "user", "content": "what is 4+4?"}]
    plain = chat(stack, "s1", messages, max_tokens=8, temperature=0)
    stream = chat(stack, "s2", messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_weight_push_mid_turn_records_both_versions(stack, chat_models, mode: str) -> None:
    engine = stack["engine"].url
    try:
        push_mid_turn(stack, chat_models, engine, mode)
    finally:  # the next mode starts from version 0 whatever happened here
        asyncio.run(_call(engine, lambda c: c.update_weights_from_disk(chat_models[0], weight_version="0")))


def push_mid_turn(stack, chat_models, engine: str, mode: str) -> None:
    for attempt in range(3):
        session = f"push-{mode}-{attempt}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            steps = _steps(engine)
            reply = pool.submit(chat, stack, session, [{"role": "user", "content": "count"}], max_tokens=200,
                                temperature=0)
            deadline = time.monotonic() + 10
            # Push once the turn has tokens: its prefill and two decode steps ran (a push while the request
            # waits for its prefill lands before its first token, and the whole turn has one version).
            while (_live(engine) == 0 or _steps(engine) < steps + 3) and time.monotonic() < deadline:
                time.sleep(0.002)

            async def push(client):
                await client.pause_generation(mode)
                await client.update_weights_from_disk(chat_models[1 - attempt % 2], weight_version=f"{attempt + 1}",
                                                      flush_cache=False)  # requests wait at the pause
                await client.continue_generation()
            asyncio.run(_call(engine, push))
            reply.result(timeout=120)
        turn = trajectory(stack, session)["turns"][0]
        versions = turn["versions"]
        if len(set(versions)) == 2:  # the push landed inside the turn
            break
    else:
        pytest.fail(f"the push never landed inside a 200-token turn ({mode})")
    assert versions == sorted(versions) and versions[-1] == attempt + 1
    assert turn["num_resumes"] == (1 if mode == "abort" else 0)


def test_tools_are_offered_and_tool_results_rendered(stack) -> None:
    messages = [{"role": "user", "content": "what is 2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    chat(stack, "tools", messages, tools=TOOLS, max_tokens=4, temperature=0)
    t = trajectory(stack, "tools")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(stack["engine"].model_dir)
    prompt = tok.decode(t["token_ids"][:t["turns"][0]["prompt_len"]])
    assert prompt.startswith("<|im_start|>system\ntools: calc<|im_end|>")
    assert '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs,error,param", [
    ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ({"messages": [{"role": "user"}]}, openai.BadRequestError, "messages[0].content"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, openai.BadRequestError, "tools[0].function.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{not json"}}]}]},
     openai.BadRequestError, "messages[0].tool_calls[0].function.arguments"),
    ({"n": 3}, openai.BadRequestError, "n"),
])
def test_bad_input_gets_openai_errors_naming_the_field(stack, kwargs, error, param) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(error) as err:
        stack["client"].chat.completions.create(**body, extra_headers={"X-Session-Id": "bad"})
    assert err.value.body["param"] == param
    r = httpx.get(f"{stack['url']}/v1/trajectories/bad", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404  # nothing recorded for a refused request


def test_engine_refusals_and_auth(stack) -> None:
    with pytest.raises(openai.BadRequestError, match="the engine refused the request"):
        chat(stack, "long", [{"role": "user", "content": "9" * 300}], max_tokens=4)
    assert httpx.get(f"{stack['url']}/v1/trajectories/long", headers={"Authorization": f"Bearer {KEY}"}).json()[
        "turns"] == []  # the session exists, the refused turn left nothing in it
    bad = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
