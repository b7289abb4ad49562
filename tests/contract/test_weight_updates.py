"""Weight updates (SGLang 0.5.23 request formats): from disk, from tensor (shared memory), from a gloo
broadcast where this test process is rank 0. After each, the engine's logprobs equal a teacher-forced
forward of the new weights and meta_info.weight_version is the version sent with the update.

Model sequence on the session's server:
    seed0 ─disk→ seed1 ─tensor→ seed0 ─dist→ seed1 ─dist(bucket)→ seed0,
then the checkpoint again under its label "default" (restore_checkpoint) for the modules after this one.
"""

from __future__ import annotations

import base64
import io
import threading
from datetime import timedelta

import pytest

from megatron_flash.ports import free_ports
from tests.contract.helpers import assert_logprobs_match, generate, http, post, restore_checkpoint, teacher_logprobs

PROMPT = [1, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def server(engine):
    """The session's engine (a real SGLang start costs ~30 s), put back as it was after the module."""
    yield engine
    restore_checkpoint(engine)


def _state_dict(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _expect_serving(server, model_dir: str, other_dir: str, version: str) -> None:
    out = generate(server.url, PROMPT, return_logprob=True,
                   sampling_params={"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True})
    assert out["meta_info"]["weight_version"] == version
    assert_logprobs_match(model_dir, PROMPT, out, temperature=1.0)
    other = teacher_logprobs(other_dir, PROMPT, out["output_ids"], temperature=1.0)
    assert max(abs(e[0] - o) for e, o in zip(out["meta_info"]["output_token_logprobs"], other)) > 1e-2, \
        "logprobs also match the previous weights: the update changed nothing"
    status, info = http("GET", server.url + "/model_info")
    assert status == 200 and info["weight_version"] == version


def test_update_weights_from_disk(server, seed1_model: str) -> None:
    status, body = post(server.url + "/update_weights_from_disk",
                        {"model_path": seed1_model, "weight_version": "disk-1"})
    assert status == 200 and body["success"] is True, body
    assert "num_paused_requests" in body
    _expect_serving(server, seed1_model, server.model_dir, "disk-1")
    status, info = http("GET", server.url + "/model_info")
    assert info["model_path"] == seed1_model

    status, body = post(server.url + "/update_weights_from_disk", {"model_path": "/nonexistent/model"})
    assert status == 400 and body["success"] is False


def test_update_weights_from_tensor_shared_memory(server, seed1_model: str) -> None:
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    mp.set_sharing_strategy("file_system")  # CPU tensors travel as shared-memory files
    named = sorted(_state_dict(server.model_dir).items())
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)  # SGLang's MultiprocessingSerializer.serialize
    payload = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()],
               "load_format": None, "flush_cache": True, "weight_version": "tensor-2"}

    status, body = post(server.url + "/update_weights_from_tensor", payload)
    assert status == 400 and body["success"] is False, "an update outside begin/end must be refused"

    assert post(server.url + "/begin_weight_update", {})[0] == 200
    status, body = post(server.url + "/update_weights_from_tensor", payload)
    assert status == 200 and body["success"] is True, body
    assert post(server.url + "/end_weight_update", {})[0] == 200
    _expect_serving(server, server.model_dir, seed1_model, "tensor-2")
    del named  # the shared-memory files live until the server has copied them


def _rank0_group(port: int, world_size: int, group_name: str):
    """Rank 0 of the update group, joined the way SGLang's trainer-side helper does."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=120)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    group, _ = _new_process_group_helper(size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(post(url, body, timeout=180)), daemon=True)
    thread.start()
    return thread, result


def test_update_weights_from_distributed_gloo(server, seed1_model: str) -> None:
    import torch
    import torch.distributed as dist

    port, group_name = free_ports(), "contract_group"
    thread, result = _post_in_thread(server.url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group_name, "backend": "gloo"})
    group = _rank0_group(port, 2, group_name)
    thread.join(120)
    assert result and result[0][0] == 200 and result[0][1]["success"] is True, result

    def send(model_dir: str, version: str, load_format: str | None) -> None:
        named = sorted(_state_dict(model_dir).items())
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": group_name, "flush_cache": True,
                "weight_version": version, "load_format": load_format}
        assert post(server.url + "/begin_weight_update", {})[0] == 200
        thread, result = _post_in_thread(server.url + "/update_weights_from_distributed", body)
        if load_format == "flattened_bucket":
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named])
            dist.broadcast(flat, src=0, group=group)
        else:
            for _, tensor in named:
                dist.broadcast(tensor.contiguous(), src=0, group=group)
        thread.join(120)
        assert result and result[0][0] == 200 and result[0][1]["success"] is True, result
        assert post(server.url + "/end_weight_update", {})[0] == 200

    send(seed1_model, "dist-3", None)
    _expect_serving(server, seed1_model, server.model_dir, "dist-3")
    send(server.model_dir, "dist-4", "flattened_bucket")
    _expect_serving(server, server.model_dir, seed1_model, "dist-4")
    # The engine leaves the group too: the server is shared, and a group held open would outlive this test.
    status, body = post(server.url + "/destroy_weights_update_group", {"group_name": group_name})
    assert status == 200 and body["success"] is True, body
    dist.destroy_process_group(group)
