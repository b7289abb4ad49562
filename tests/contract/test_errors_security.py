"""Errors and auth: oversized requests and malformed JSON get a 400 and leave the server healthy; an API key
is enforced as SGLang does (401 without, 200 with, /health always open); a bad model path exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.contract.conftest import BACKENDS, REPO, launch_engine
from tests.contract.helpers import generate, http, post


def test_oversized_request_is_rejected_and_server_stays_up(engine) -> None:
    status, body = post(engine.url + "/generate",
                        {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 100000}})
    assert status == 400, (status, body)
    message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
    assert "context length" in message and "100003" in message, message
    assert http("GET", engine.url + "/health")[0] == 200
    out = generate(engine.url, [1, 5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3


def test_malformed_json_is_400(engine) -> None:
    status, body = http("POST", engine.url + "/generate", raw=b'{"input_ids": [1, 2,')
    assert status == 400, (status, body)
    assert http("GET", engine.url + "/health")[0] == 200


@pytest.fixture(scope="module", params=BACKENDS)
def keyed_server(request: pytest.FixtureRequest, tiny_models: dict[str, str],
                 tmp_path_factory: pytest.TempPathFactory):
    server = launch_engine(request.param, tiny_models["llama"], str(tmp_path_factory.mktemp("auth_logs")),
                           api_key="contract-secret")
    yield server
    server.stop()


def test_api_key(keyed_server) -> None:
    body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    assert post(keyed_server.url + "/generate", body)[0] == 401
    assert post(keyed_server.url + "/generate", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    status, out = post(keyed_server.url + "/generate", body, headers={"Authorization": "Bearer contract-secret"})
    assert status == 200 and len(out["output_ids"]) == 2
    assert post(keyed_server.url + "/update_weights_from_disk", {"model_path": keyed_server.model_dir})[0] == 401
    assert http("GET", keyed_server.url + "/health")[0] == 200


def test_local_server_unknown_model_path_exits_nonzero(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "megatron_flash.engines.local_server", "--model-path",
                           str(tmp_path / "missing"), "--port", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "missing" in proc.stderr and "model" in proc.stderr.lower(), proc.stderr
