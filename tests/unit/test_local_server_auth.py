"""The local engine server's refusals, checked on the ASGI app in process:
a token as SGLang's --api-key (`Authorization: Bearer KEY`, 401 without it), and weight endpoints
refused (403) on a non-loopback host without a key. Requests that pass reach the endpoints."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from megatron_flash.engines.local_server import build_app


class Healthy:
    """Just enough engine for /health (the only endpoint these requests reach)."""

    def healthy(self) -> bool:
        return True


def client(**kw) -> TestClient:
    return TestClient(build_app(Healthy(), **kw))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                                     {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cret "}])
def test_without_the_token_every_endpoint_but_health_is_401(headers):
    c = client(api_key="s3cret", host="0.0.0.0")
    for path in ("/generate", "/update_weights_from_disk", "/flush_cache", "/no_such_path"):
        r = c.post(path, json={}, headers=headers)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, headers, r.text)
    assert c.get("/health", headers=headers).status_code == 200


def test_with_the_token_requests_pass_on_to_the_app():
    c = client(api_key="s3cret", host="0.0.0.0")
    for auth in ("Bearer s3cret", "bearer s3cret"):  # the scheme is case-insensitive, the key is not
        # past the check, an unknown path is the app's own 404 (not 401): the request reached routing
        assert c.post("/no_such_path", json={}, headers={"Authorization": auth}).status_code == 404
    assert c.post("/no_such_path", json={}, headers={"Authorization": "Bearer S3CRET"}).status_code == 401


@pytest.mark.parametrize("path", ["/update_weights_from_disk", "/update_weights_from_shared_memory",
                                  "/update_weights_from_tensor", "/update_weights_from_distributed"])
def test_weight_endpoints_are_refused_off_loopback_without_a_key(path):
    c = client(host="0.0.0.0")
    r = c.post(path, json={"model_path": "/x"})
    assert r.status_code == 403 and path in r.json()["error"]
    assert c.post("/no_such_path", json={}).status_code == 404  # other paths are not guarded
    # on loopback the same request reaches the endpoint (which then fails on the stub engine, not 403)
    with TestClient(build_app(Healthy(), host="127.0.0.1"), raise_server_exceptions=False) as loop:
        assert loop.post("/update_weights_from_disk", json={"model_path": "/x"}).status_code not in (401, 403)


def test_device_and_dtype_are_checked_with_the_flag_named():
    import torch

    from megatron_flash.engines.local_engine import engine_device, engine_dtype

    assert engine_dtype("bfloat16") is torch.bfloat16 and engine_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16, got 'int8'"):
        engine_dtype("int8")
    with pytest.raises(ValueError, match="--device must be cpu or cuda"):
        engine_device("meta")
    with pytest.raises(ValueError, match="--device 'gpu'"):
        engine_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device 'cuda': this torch has no usable CUDA device"):
            engine_device("cuda")
