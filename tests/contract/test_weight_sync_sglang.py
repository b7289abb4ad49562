"""The weight bridge against every contract backend: a single-rank Megatron trainer (tools/weight_sync/
verify.py as a subprocess) pushes its weights with each transport into the session's server (put back
to the checkpoint after the module).

    make test           → the local engine server
    make test-sglang    → real SGLang 0.5.23 on CPU (MF_CONTRACT_BACKENDS=sglang)

What a pass proves, per transport, on the real wire format: pause → begin → buckets (ForkingPickler
payloads / a gloo group the engine joins / a safetensors directory) → update_weight_version → end →
flush → continue; afterwards the engine samples with behavior logprobs equal to the trainer's own
logprobs of the same tokens (≤ 1e-4, fp32), reports the new weight_version, and the bridge's post-sync
probe (SGLang's teacher-forced input logprobs, `logprob_start_len`) agrees with the trainer too.

With the local engine on CUDA (backend `cuda`, tests/gpu) the engine shares the trainer's GPU, where NCCL
cannot broadcast: there the bridge must refuse broadcast by name (ipc is the transport for that layout).

One verify.py launch syncs with every transport in turn (one trainer start-up instead of three; on a
GPU engine broadcast is refused by name in a launch of its own). Before each sync two more SGD steps
move the weights, and the engine's logprobs just before it must differ from the trainer's (stale diff
> STALE_MIN): a transport that silently did nothing would leave the previous transport's weights and
fail the comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tests.contract.conftest import REPO
from tests.contract.helpers import http, post, restore_checkpoint, teacher_logprobs

TRANSPORTS = ("ipc", "broadcast", "disk")
FIRST_VERSION, STEPS = 11, 2  # each sync's version: FIRST_VERSION + its index among the launch's transports
STALE_MIN = 1e-2  # two SGD steps move the logprobs by far more (as in tests/distributed/test_weight_sync.py)


@pytest.fixture(scope="module")
def server(engine):
    """The session's engine (a real SGLang start costs ~30 s), put back as it was after the module."""
    yield engine
    restore_checkpoint(engine)


def test_input_logprobs_for_the_probe(server) -> None:
    """The probe's request (runs first: the server still has the checkpoint's weights): SGLang's
    `logprob_start_len` semantics, equal to an independent teacher-forced forward."""
    from megatron_flash.engines.client import EngineClient
    from megatron_flash.weight_sync import probe

    with open(os.path.join(server.model_dir, "config.json")) as f:
        tokens = probe.probe_tokens(json.load(f)["vocab_size"])
    async def score() -> list:
        async with EngineClient(server.url) as client:
            return await client.score(tokens.tolist(), logprob_start_len=probe.PROMPT_LEN - 1)
    reply = asyncio.run(score())
    first = reply[0]["meta_info"]["input_token_logprobs"]
    assert first[0][0] is None and [e[1] for e in first] == tokens[0, probe.PROMPT_LEN - 1:].tolist()
    engine = probe.parse_continuation_logprobs(reply, tokens, probe.PROMPT_LEN, url=server.url)
    for row, values in zip(tokens.tolist(), engine):
        reference = teacher_logprobs(server.model_dir, row[:probe.PROMPT_LEN], row[probe.PROMPT_LEN:], temperature=1.0)
        assert max(abs(a - b) for a, b in zip(values, reference)) <= 1e-4
    status, reply = post(server.url + "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                                    "logprob_start_len": 4, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 or "logprob_start_len" in str(reply), reply  # past the prompt: refused


def run_verify(server, model_dir: str, transports: list[str], out_dir, *extra: str) -> tuple[int, list[dict], str]:
    """tools/weight_sync/verify.py against `server` with `transports` in turn: (exit code, its JSON lines, stderr)."""
    out, err = out_dir / "stdout", out_dir / "stderr"
    # Output to files, not pipes: with ipc the trainer's torch_shm_manager daemon inherits its stdout/stderr
    # and lives as long as the session's server (a client of it), so a pipe would never reach EOF.
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run([sys.executable, "tools/weight_sync/verify.py", "--model-path", model_dir,
                               *[a for t in transports for a in ("--transport", t)], "--engine-url", server.url,
                               "--steps", str(STEPS), "--version", str(FIRST_VERSION), *extra], cwd=REPO, stdout=stdout,
                              stderr=stderr, timeout=300 + 100 * len(transports),
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}).returncode
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    return code, rows, err.read_text()


def gpu_shared(server, transport: str) -> bool:
    """With the local engine on CUDA the engine shares the trainer's one GPU, where NCCL cannot broadcast."""
    return transport == "broadcast" and server.backend == "cuda"


@pytest.fixture(scope="module")
def synced(server, tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """transport → its sync's JSON line, from one verify.py launch that syncs with each transport in turn."""
    transports = [t for t in TRANSPORTS if not gpu_shared(server, t)]
    code, rows, err = run_verify(server, tiny_models["llama"], transports, tmp_path_factory.mktemp("verify"))
    assert code in (0, 1) and [r["transport"] for r in rows] == transports, (
        f"verify crashed (exit {code}):\n{err[-4000:]}\n--- server log ---\n{server.log_tail()}")
    # The label the engine reports outside a reply is the last sync's.
    status, info = http("GET", server.url + "/model_info")
    assert status == 200 and info["weight_version"] == str(FIRST_VERSION + len(transports) - 1), info
    return {r["transport"]: r for r in rows}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bridge_sync_is_exact_on_the_engine(server, synced: dict[str, dict], tiny_models: dict[str, str], tmp_path,
                                            transport: str) -> None:
    if gpu_shared(server, transport):
        code, _, err = run_verify(server, tiny_models["llama"], [transport], tmp_path)
        assert code == 1 and "own GPU" in err, err[-4000:]
        return
    result = synced[transport]
    version = FIRST_VERSION + [t for t in TRANSPORTS if not gpu_shared(server, t)].index(transport)
    assert result["synced_urls"] == [server.url] and result["failed_urls"] == [], result
    assert result["weight_versions"] == [str(version)], result
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert result["probe_max_abs_logprob_diff"] <= 1e-4, result
    assert result["stale_max_abs_logprob_diff"] > STALE_MIN, result


def test_delta_pushes_where_the_engine_takes_them_whole_pushes_elsewhere(server, tiny_models: dict[str, str],
                                                                       tmp_path) -> None:
    """weight_sync.delta=auto, two syncs per transport through one bridge: the local engine advertises
    `weight_update_delta` and gets a full push with checksums, then a delta; SGLang does not (it has no
    delta loader yet) and gets two plain pushes. Either way the engine serves the trainer's weights
    exactly. With delta=on an engine that takes no delta is refused by URL before anything is sent."""
    transports = [t for t in ("broadcast", "disk") if not gpu_shared(server, t)]
    code, rows, err = run_verify(server, tiny_models["llama"], transports, tmp_path, "--delta", "auto", "--syncs", "2")
    assert code == 0 and len(rows) == 2 * len(transports), f"exit {code}:\n{err[-4000:]}\n{server.log_tail()}"
    takes_delta = server.backend != "sglang"
    for first, second in zip(rows[::2], rows[1::2]):
        assert first["modes"] == ({"full": 1} if takes_delta else {"plain": 1}), first
        assert second["modes"] == ({"delta": 1} if takes_delta else {"plain": 1}), second
        for row in (first, second):
            assert row["max_abs_logprob_diff"] <= 1e-4 and row["stale_max_abs_logprob_diff"] > STALE_MIN, row
    if not takes_delta:
        out = tmp_path / "on"
        out.mkdir()
        code, rows, err = run_verify(server, tiny_models["llama"], transports[:1], out, "--delta", "on")
        assert code == 1 and rows == [] and f"weight_sync.delta=on but engine {server.url} takes no delta" in err, err[-3000:]
