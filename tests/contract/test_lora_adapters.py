"""SGLang's dynamic LoRA API, over raw HTTP, on every backend: what a push of adapters by name relies on.

Both backends (the local engine with `--enable-lora`; real SGLang 0.5.23 on CPU with `--enable-lora
--lora-backend torch_native`, its pinned-memory requests made no-ops by tools/sglang_cpu/site: a CPU
torch has no pinned allocator and SGLang 0.5.23 refuses to start with LoRA otherwise):
  * /load_lora_adapter (a PEFT folder) and /load_lora_adapter_from_tensors (SGLang's flattened bucket,
    pickled into shared memory, with the adapter_config as config_dict) load an adapter under a name;
  * a request naming it (`lora_path`) scores what PEFT's own model gives with that adapter (1e-5, fp32);
  * loading a name twice, and naming one never loaded, are refused (400) with SGLang's messages;
  * unloading a name makes requests naming it refused (SGLang first tries to load the name implicitly,
    as a folder or Hub id).
Where they differ (engines/local_lora.py; the bridge relies on both):
  * SGLang serves many adapters at once, each request on the one it names, and a request naming none
    gets the base model; its meta_info carries no lora_path (the label of a sample is its request's name).
  * The local engine serves one, merged: a request naming a superseded adapter runs on the newer one and
    meta_info.lora_path says so; a request naming none while an adapter is merged in is refused.
The reference adapters are random (B ≠ 0) PEFT tensors for the tiny Llama, written here.
"""

from __future__ import annotations

import base64
import io
import os

import pytest
import torch

from tests.contract.conftest import launch_engine
from tests.contract.helpers import http, post

IDS = [5, 9, 12, 7, 3, 22, 14, 8, 11, 6]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SGLANG_LORA = ["--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", "8",
               "--lora-target-modules", *MODULES]


@pytest.fixture(scope="module")
def lora_engine(engine, tiny_models, tmp_path_factory):
    """The local session engine (started with --enable-lora), left with no adapter; SGLang needs LoRA
    at launch, so its own server."""
    if engine.local:
        yield engine
        for name in list(http("GET", engine.url + "/get_server_info")[1].get("loaded_adapters", {})):
            post(engine.url + "/unload_lora_adapter", {"lora_name": name})
        assert not http("GET", engine.url + "/get_server_info")[1].get("loaded_adapters"), "adapters left behind"
        return
    server = launch_engine(engine.backend, tiny_models["llama"], str(tmp_path_factory.mktemp("lora_engine")),
                           sglang_args=SGLANG_LORA)
    yield server
    server.stop()


def random_adapter(model_dir: str, seed: int, rank: int = 4) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT config and tensors (PEFT's names) for every linear of the model's layers."""
    from safetensors import safe_open

    from megatron_flash.hf.adapters import PEFT_PREFIX, peft_config

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in MODULES:
                out_f, in_f = f.get_slice(name).get_shape()
                tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.3
                tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.3
    config = peft_config(rank=rank, alpha=8, dropout=0.0, targets=("qkv", "proj", "fc1", "fc2"), base_model=model_dir)
    return config, tensors


def peft_logprobs(model_dir: str, folder: str) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([IDS])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return lp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def score(url: str, lora: str | None, expect: int = 200):
    body = {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
    if lora is not None:
        body["lora_path"] = lora
    status, out = post(url + "/generate", body)
    assert status == expect, (status, out)
    if status != 200:
        return out
    return [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]], out["meta_info"]


def flattened_payload(tensors: dict[str, torch.Tensor]) -> str:
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    from megatron_flash.weight_sync.transports.flat_bucket import flatten_by_dtype

    mp.set_sharing_strategy("file_system")
    ((flat, metadata),) = flatten_by_dtype(sorted(tensors.items()), shared=True)
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    flattened_payload.keep = flat  # the shared-memory file lives until the engine has read it
    return base64.b64encode(buf.getvalue()).decode()


def worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_adapters_by_name(lora_engine, tiny_models, tmp_path) -> None:
    from megatron_flash.hf.adapters import write_peft_adapter

    url, model = lora_engine.url, tiny_models["llama"]
    folders = {}
    adapters = {}
    for name, seed in (("a1", 1), ("a2", 2)):
        config, tensors = random_adapter(model, seed)
        adapters[name] = (config, tensors)
        folders[name] = str(tmp_path / name)
        write_peft_adapter(folders[name], {k.removeprefix("base_model.model."): v for k, v in tensors.items()}, config)
    want = {name: peft_logprobs(model, folder) for name, folder in folders.items()}
    base, _ = score(url, None)
    assert worst(want["a1"], base) > 0.1 and worst(want["a1"], want["a2"]) > 0.1  # the checks below can fail

    status, out = post(url + "/load_lora_adapter", {"lora_name": "a1", "lora_path": folders["a1"]})
    assert status == 200 and out["success"], out
    got, meta = score(url, "a1")
    assert worst(got, want["a1"]) <= 1e-5

    config, tensors = adapters["a2"]
    body = {"lora_name": "a2", "config_dict": config, "serialized_named_tensors": [flattened_payload(tensors)],
            "load_format": "flattened_bucket"}
    status, out = post(url + "/load_lora_adapter_from_tensors", body)
    assert status == 200 and out["success"], out
    got, meta_a2 = score(url, "a2")
    assert worst(got, want["a2"]) <= 1e-5

    status, out = post(url + "/load_lora_adapter_from_tensors", body)  # the same name again
    assert status == 400 and "already loaded" in out["error_message"], out
    refused = score(url, "never-loaded", expect=400)
    assert "never been loaded" in refused["error"]["message"], refused

    superseded, meta_a1 = score(url, "a1")
    if lora_engine.local:  # one adapter, merged: a1 now runs on a2, and says so
        assert worst(superseded, want["a2"]) <= 1e-5 and meta_a1["lora_path"] == "a2"
        assert meta_a2["lora_path"] == "a2"
        no_name = score(url, None, expect=400)
        assert "must name it" in no_name["error"]["message"], no_name
    else:  # SGLang: each request on the adapter it names; no lora_path in meta_info; none named = the base
        assert worst(superseded, want["a1"]) <= 1e-5
        assert "lora_path" not in meta_a1 and "lora_path" not in meta_a2
        got, _ = score(url, None)
        assert worst(got, base) <= 1e-6

    status, out = post(url + "/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200 and out["success"], out
    refused = score(url, "a2", expect=400)
    # SGLang, asked for a name it unloaded, tries to load it again implicitly, as a folder or Hub id (no
    # such folder here, the Hub is offline): adapter names must never be paths (ours: policy-v{N})
    assert any(m in refused["error"]["message"] for m in ("never been loaded", "Failed to implicitly load")), refused
    if lora_engine.local:  # the base is back, and with it requests that name nothing
        got, _ = score(url, None)
        assert worst(got, base) <= 1e-6
