"""EngineClient against a fake SGLang engine: parsing, typed errors, timeouts, retries, auth,
weight-update sessions. The reply shapes are SGLang 0.5.23's (see engine_client's docstring)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import pytest

from megatron_flash.ports import free_ports
from megatron_flash.engines.client import (EngineClient, EngineHTTPError, EngineTimeout,
                                                  EngineUnreachable, MalformedReply, WeightVersionSpan,
                                                  parse_generate_reply)
from tests.unit.fake_engine import FakeEngine


def run_with_fake(test: Callable[[FakeEngine, EngineClient], Awaitable[Any]], *, client_kwargs: Any = None,
                  **fake_kwargs: Any) -> Any:
    async def main() -> Any:
        fake = FakeEngine(**fake_kwargs)
        url = await fake.start()
        client = EngineClient(url, retry_backoff_s=0.01, **(client_kwargs or {}))
        try:
            return await asyncio.wait_for(test(fake, client), 20)
        finally:
            await client.close()
            await fake.close()

    return asyncio.run(main())



# -- parsing --------------------------------------------------------------------------------------
SGLANG_REPLY = {  # a real 0.5.23 reply's shape: stop on a matched token, spans over a weight update
    "text": "ab", "output_ids": [5, 6, 2],
    "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4,
                  "weight_version": "7", "num_retractions": 0, "reasoning_tokens": 0,
                  "completion_tokens": 3, "cached_tokens": 1,
                  "weight_versions": [{"version": "6", "start": 0, "end": 2},
                                      {"version": "7", "start": 2, "end": 3}],
                  "output_token_logprobs": [[-0.1, 5, None], [-1.25, 6, None], [-0.01, 2, None]]},
}


def parse(reply: Any, **kw: Any):
    return parse_generate_reply(reply, url="http://127.0.0.1:30001", rid="r1", input_len=4,
                                return_logprob=kw.pop("return_logprob", True), **kw)


def test_parse_full_reply() -> None:
    r = parse(SGLANG_REPLY)
    assert r.output_ids == [5, 6, 2]
    assert r.output_logprobs == [-0.1, -1.25, -0.01]
    assert (r.finish_reason, r.finish_matched) == ("stop", 2)
    assert r.weight_version == "7"
    assert r.weight_version_spans == [WeightVersionSpan("6", 0, 2), WeightVersionSpan("7", 2, 3)]
    assert r.min_weight_version == "6"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (4, 3, 1)
    assert r.rid == "r1" and r.engine_url == "http://127.0.0.1:30001" and not r.aborted


def test_parse_abort_in_waiting_queue_has_no_prompt_tokens() -> None:
    # tokenizer_manager.py builds this meta_info for a request aborted before it ran.
    reply = {"text": "", "output_ids": [],
             "meta_info": {"id": "r1", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                           "weight_version": "3", "e2e_latency": 0.1, "output_token_logprobs": [],
                           "completion_tokens": 0}}
    r = parse(reply)
    assert r.aborted and r.finish_message == "Abort in waiting queue"
    assert (r.prompt_tokens, r.completion_tokens, r.output_logprobs) == (4, 0, [])


def _without(path: str) -> dict:
    import copy

    reply = copy.deepcopy(SGLANG_REPLY)
    *parents, last = path.split(".")
    node = reply
    for p in parents:
        node = node[p]
    del node[last]
    return reply


@pytest.mark.parametrize("path, field", [
    ("meta_info.output_token_logprobs", "meta_info.output_token_logprobs"),
    ("meta_info.finish_reason", "meta_info.finish_reason"),
    ("meta_info.weight_version", "meta_info.weight_version"),
    ("output_ids", "output_ids"),
    ("meta_info", "meta_info"),
])
def test_malformed_reply_names_the_field(path: str, field: str) -> None:
    with pytest.raises(MalformedReply) as info:
        parse(_without(path))
    assert info.value.field == field
    assert str(info.value).startswith("http://127.0.0.1:30001/generate: ")
    assert field in str(info.value)


def test_missing_logprobs_message() -> None:
    with pytest.raises(MalformedReply, match=r"^http://127\.0\.0\.1:30001/generate: reply lacks "
                                             r"meta_info\.output_token_logprobs \(asked with return_logprob=true\)$"):
        parse(_without("meta_info.output_token_logprobs"))
    assert parse(_without("meta_info.output_token_logprobs"), return_logprob=False).output_logprobs is None


def test_logprobs_must_align_with_output_ids() -> None:
    import copy

    short = copy.deepcopy(SGLANG_REPLY)
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(MalformedReply, match="has 2 entries for 3 output_ids"):
        parse(short)
    wrong = copy.deepcopy(SGLANG_REPLY)
    wrong["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(MalformedReply, match=r"output_token_logprobs\[1\] is for token 9 but output_ids\[1\] is 6"):
        parse(wrong)
    bad_finish = copy.deepcopy(SGLANG_REPLY)
    bad_finish["meta_info"]["finish_reason"] = {"type": "eos"}
    with pytest.raises(MalformedReply, match="finish_reason"):
        parse(bad_finish)
    with pytest.raises(MalformedReply, match="expected a JSON object"):
        parse([SGLANG_REPLY])


# -- over HTTP ------------------------------------------------------------------------------------
def test_generate_sends_sglang_body_and_parses() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        r = await client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 1.0}, rid="abc")
        assert r.rid == "abc" and r.output_ids == [100, 101, 102, 103]
        assert r.output_logprobs == [-0.5] * 4 and r.finish_reason == "length"
        assert r.weight_version == "0" and r.prompt_tokens == 3 and r.engine_url == fake.url
        sent = fake.requests[-1]
        assert sent["path"] == "/generate"
        assert sent["body"] == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
                                "return_logprob": True, "rid": "abc"}
        generated = await client.generate([1], {})
        assert len(generated.rid) == 32  # a fresh uuid when none is given

    run_with_fake(body)


def test_malformed_http_reply_names_url_and_field() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        def drop(reply: dict) -> dict:
            del reply["meta_info"]["output_token_logprobs"]
            return reply

        fake.mutate_reply = drop
        with pytest.raises(MalformedReply) as info:
            await client.generate([1], {})
        assert str(info.value) == (f"{fake.url}/generate: reply lacks meta_info.output_token_logprobs "
                                   "(asked with return_logprob=true)")

    run_with_fake(body)


def test_control_calls_send_sglang_bodies() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        await client.abort("r9")
        await client.abort_all()
        await client.pause_generation("retract")
        await client.continue_generation()
        await client.flush_cache()
        assert await client.model_info() == {"model_path": "fake", "is_generation": True, "weight_version": "0"}
        await client.update_weights_from_disk("/ckpt/step5", weight_version="5")
        assert await client.get_weight_version() == "5"
        await client.init_weights_update_group(master_address="10.0.0.1", master_port=29500, rank_offset=1,
                                               world_size=3, backend="gloo")
        bodies = {r["path"]: r["body"] for r in fake.requests}
        assert [r["body"] for r in fake.requests[:2]] == [{"rid": "r9", "abort_all": False},
                                                           {"rid": "", "abort_all": True}]
        assert bodies["/pause_generation"] == {"mode": "retract"}
        assert bodies["/continue_generation"] == {}
        assert bodies["/update_weights_from_disk"] == {"model_path": "/ckpt/step5", "load_format": None,
                                                       "weight_version": "5", "flush_cache": True}
        assert bodies["/init_weights_update_group"] == {"master_address": "10.0.0.1", "master_port": 29500,
                                                        "rank_offset": 1, "world_size": 3,
                                                        "group_name": "weight_update_group", "backend": "gloo"}
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause_generation("stop")

    run_with_fake(body)


def test_weight_updates_are_wrapped_in_a_session() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        await client.update_weights_from_tensor([b"\x00\x01", "AAE="], weight_version="1")
        assert fake.paths() == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
        assert fake.requests[1]["body"]["serialized_named_tensors"] == ["AAE=", "AAE="]  # bytes → base64
        fake.requests.clear()
        async with client.weight_update_session():  # one session for several buckets
            for i in range(3):
                await client.update_weights_from_distributed(names=[f"w{i}"], dtypes=["float32"], shapes=[[2, 3]],
                                                             weight_version="2")
        assert fake.paths() == ["/begin_weight_update"] + ["/update_weights_from_distributed"] * 3 + [
            "/end_weight_update"]
        assert fake.requests[1]["body"] == {"names": ["w0"], "dtypes": ["float32"], "shapes": [[2, 3]],
                                            "group_name": "weight_update_group", "flush_cache": True,
                                            "weight_version": "2", "load_format": None}
        assert not fake.session_open and await client.get_weight_version() == "2"

    run_with_fake(body)


def test_session_auto_detects_a_server_without_session_endpoints() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        await client.update_weights_from_tensor(["AA=="])
        await client.update_weights_from_tensor(["AA=="])
        # 404 on the first begin is remembered: the second update goes straight through.
        assert fake.paths() == ["/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor"]

    run_with_fake(body, session_endpoints=False)


def test_session_always_requires_the_endpoints() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        with pytest.raises(EngineHTTPError) as info:
            await client.update_weights_from_tensor(["AA=="])
        assert info.value.status == 404 and "/begin_weight_update" in str(info.value)

    run_with_fake(body, session_endpoints=False, client_kwargs={"weight_update_session": "always"})


def test_failed_update_raises_and_closes_the_session() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        fake.fail["/update_weights_from_tensor"] = 400
        with pytest.raises(EngineHTTPError, match=r"/update_weights_from_tensor: HTTP 400"):
            await client.update_weights_from_tensor(["AA=="])
        assert fake.paths()[-1] == "/end_weight_update" and not fake.session_open
        # Without a session SGLang answers 400 {"success": false, ...}: the message reaches the error.
        del fake.fail["/update_weights_from_tensor"]
        async with EngineClient(fake.url, weight_update_session="never") as sessionless:
            with pytest.raises(EngineHTTPError, match="must run between begin_weight_update"):
                await sessionless.update_weights_from_tensor(["AA=="])

    run_with_fake(body)


def test_api_key_sent_as_bearer() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        await client.generate([1], {})
        await client.flush_cache()
        assert {r["auth"] for r in fake.requests} == {"Bearer s3cret"}
        anonymous = EngineClient(fake.url, max_retries=0)
        with pytest.raises(EngineHTTPError) as info:
            await anonymous.generate([1], {})
        await anonymous.close()
        assert info.value.status == 401

    run_with_fake(body, api_key="s3cret", client_kwargs={"api_key": "s3cret"})


def test_timeout_is_typed_and_names_the_endpoint() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        with pytest.raises(EngineTimeout, match=rf"^{fake.url}/generate: no reply within 0.2s$"):
            await client.generate([1], {}, timeout_s=0.2)
        assert isinstance(EngineTimeout("u", "/e", "d"), EngineUnreachable)
        assert fake.completed == []

    run_with_fake(body, latency_s=3.0)


def test_idempotent_calls_retry_transient_errors() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        fake.fail["/model_info"] = 503
        fake.fail_count["/model_info"] = 2
        assert (await client.model_info())["weight_version"] == "0"
        assert fake.paths().count("/model_info") == 3
        # A 4xx is not transient: no retry.
        fake.fail["/flush_cache"] = 400
        with pytest.raises(EngineHTTPError):
            await client.flush_cache()
        assert fake.paths().count("/flush_cache") == 1
        # Retries are bounded: 1 + max_retries attempts.
        fake.fail["/health"] = 503
        with pytest.raises(EngineHTTPError, match=r"/health: HTTP 503"):
            await client.health()
        assert fake.paths().count("/health") == 3
        assert not await client.is_healthy()

    run_with_fake(body, client_kwargs={"max_retries": 2})


def test_generate_and_weight_updates_are_never_retried() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        for path in ("/generate", "/update_weights_from_disk", "/pause_generation"):
            fake.fail[path] = 503
        with pytest.raises(EngineHTTPError):
            await client.generate([1], {})
        with pytest.raises(EngineHTTPError):
            await client.update_weights_from_disk("/x")
        with pytest.raises(EngineHTTPError):
            await client.pause_generation()
        assert fake.paths() == ["/generate", "/update_weights_from_disk", "/pause_generation"]

    run_with_fake(body, client_kwargs={"max_retries": 3})


def test_unreachable_engine() -> None:
    async def main() -> None:
        url = f"http://127.0.0.1:{free_ports()}"
        client = EngineClient(url, max_retries=1, retry_backoff_s=0.01)
        with pytest.raises(EngineUnreachable, match=rf"^{url}/generate: cannot reach the engine"):
            await client.generate([1], {})
        with pytest.raises(EngineUnreachable, match=rf"^{url}/model_info: "):
            await client.model_info()
        assert not await client.is_healthy()
        await client.close()

    asyncio.run(main())


def test_engine_dying_mid_request_is_unreachable() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        task = asyncio.ensure_future(client.generate([1], {}))
        while not fake.started:
            await asyncio.sleep(0.01)
        await fake.die()
        with pytest.raises(EngineUnreachable, match="/generate: cannot reach the engine"):
            await task
        assert fake.completed == []

    run_with_fake(body, latency_s=5.0)


def test_abort_returns_finish_abort() -> None:
    async def body(fake: FakeEngine, client: EngineClient) -> None:
        task = asyncio.ensure_future(client.generate([1], {}, rid="r1"))
        while not fake.started:
            await asyncio.sleep(0.01)
        await client.abort("r1")
        result = await task
        assert result.aborted and result.finish_message == "Abort in running batch"
        assert result.output_ids == [100] and result.output_logprobs == [-0.5]

    run_with_fake(body, latency_s=5.0)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="http://"):
        EngineClient("127.0.0.1:3000")
    with pytest.raises(ValueError, match="weight_update_session"):
        EngineClient("http://h:1", weight_update_session="sometimes")


def test_idle_connections_are_dropped_before_the_server_closes_them() -> None:
    """uvicorn (SGLang's server and the local one) closes a keep-alive connection idle 5 s; a client that
    reused one at that moment got ServerDisconnected on /generate (seen with rounds of ~5 s)."""
    import inspect

    import uvicorn

    server_s = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default

    async def keepalive() -> float:
        client = EngineClient("http://127.0.0.1:9")
        try:
            return client._session().connector._keepalive_timeout
        finally:
            await client.close()

    assert asyncio.run(keepalive()) <= server_s - 1
