"""Colocated mode's memory hand-off (SGLang 0.5.23 `/release_memory_occupation`,
`/resume_memory_occupation`, body `{"tags": [...]}` ⊆ weights, kv_cache, cuda_graph; none = all).

The RL order: pause(abort) → release all → (trainer uses the device) → resume weights → push weights
→ resume kv_cache → continue. After it the engine must serve exactly the pushed weights. Both
backends; on our local engine server the memory really goes (weights_bytes 0 while released, checked against
the checkpoint's own tensor sizes). SGLang frees memory only with --enable-memory-saver (a CUDA
feature); on CPU its endpoints keep the weights, and the contract here is the protocol.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.contract.conftest import LOCAL_BACKEND, launch_engine
from tests.contract.helpers import assert_logprobs_match, generate, http, post, restore_checkpoint

PROMPT = [1, 8, 9, 10, 11]
PARAMS = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(engine):
    """The session's engine (a real SGLang start costs ~30 s; no launch flag is needed here), put back as it
    was after the module."""
    yield engine
    restore_checkpoint(engine)


@pytest.fixture(scope="module")
def local_server(engine, tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """Our own engine server: the session's engine where that is ours (put back as it was after the
    module), else one started here (the SGLang tier)."""
    if engine.local:
        yield engine
        restore_checkpoint(engine)
        return
    server = launch_engine(LOCAL_BACKEND, tiny_models["llama"], str(tmp_path_factory.mktemp("mem_cpu_logs")))
    yield server
    server.stop()


def checkpoint_bytes(model_dir: str) -> int:
    """fp32 bytes of every tensor in the checkpoint (the local engine server serves fp32)."""
    import math

    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())


def test_release_resume_push_then_serve_the_pushed_weights(server, seed1_model: str) -> None:
    assert post(server.url + "/pause_generation", {"mode": "abort"})[0] == 200
    status, body = post(server.url + "/release_memory_occupation", {})
    assert status == 200, body
    if server.local:
        _, info = http("GET", server.url + "/get_server_info")
        assert info["weights_bytes"] == 0 and info["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    status, body = post(server.url + "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 200, body
    status, body = post(server.url + "/update_weights_from_disk", {"model_path": seed1_model, "weight_version": "m1"})
    assert status == 200 and body["success"] is True, body
    for tags in (["kv_cache"], ["cuda_graph"]):
        status, body = post(server.url + "/resume_memory_occupation", {"tags": tags})
        assert status == 200, (tags, body)
    assert post(server.url + "/continue_generation", {})[0] == 200
    out = generate(server.url, PROMPT, return_logprob=True, sampling_params=PARAMS)
    assert out["meta_info"]["weight_version"] == "m1"
    assert_logprobs_match(seed1_model, PROMPT, out, temperature=1.0)


def test_local_server_frees_the_weights_and_requests_wait_until_resumed(local_server, tiny_models) -> None:
    url, model = local_server.url, tiny_models["llama"]
    _, info = http("GET", url + "/get_server_info")
    assert info["weights_bytes"] == checkpoint_bytes(model) and info["memory_released"] == []
    status, body = post(url + "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert status == 200 and body["after"]["weights_bytes"] == 0, body
    assert body["before"]["weights_bytes"] == checkpoint_bytes(model)
    # Not paused, but nothing can run while released: a request waits, then runs after resume + push.
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(out=generate(url, PROMPT, return_logprob=True,
                                                                         sampling_params=PARAMS)))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive(), "a request ran while the weights were released"
    assert post(url + "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    _, info = http("GET", url + "/get_server_info")
    assert info["weights_bytes"] == checkpoint_bytes(model) and info["memory_released"] == ["kv_cache"]
    status, body = post(url + "/update_weights_from_disk", {"model_path": model, "weight_version": "back"})
    assert status == 200 and body["success"], body
    assert post(url + "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    waiter.join(timeout=120)
    assert not waiter.is_alive()
    assert result["out"]["meta_info"]["weight_version"] == "back"
    assert_logprobs_match(model, PROMPT, result["out"], temperature=1.0)


def test_local_server_refuses_bad_memory_requests(local_server, tiny_models) -> None:
    url = local_server.url
    status, body = post(url + "/release_memory_occupation", {"tags": ["weights", "activations"]})
    assert status == 400 and "activations" in body["error"]["message"], body
    status, body = post(url + "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "not released" in body["error"]["message"], body
    # Released weights cannot take an update (their storage is gone) and cannot score a prompt.
    assert post(url + "/release_memory_occupation", {"tags": ["weights"]})[0] == 200
    status, body = post(url + "/update_weights_from_disk", {"model_path": tiny_models["llama"]})
    assert status == 400 and "released" in body["message"], body
    assert post(url + "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    # A busy engine refuses to release: a long request is running.
    holder = threading.Thread(target=lambda: generate(url, PROMPT, sampling_params={
        "temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}))
    assert post(url + "/update_weights_from_disk", {"model_path": tiny_models["llama"]})[0] == 200
    holder.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body = post(url + "/release_memory_occupation", {})
        if status == 400:
            break
        post(url + "/resume_memory_occupation", {})  # it was idle still: undo and try again
        time.sleep(0.01)
    assert status == 400 and "idle" in body["error"]["message"], body
    holder.join(timeout=120)
