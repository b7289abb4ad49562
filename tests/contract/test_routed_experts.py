"""MoE routes in /generate replies (SGLang's `return_routed_experts`), checked against transformers.

Contract asserted on every backend (SGLang started with --enable-return-routed-experts):
    asked with `return_routed_experts: true`, a finished reply's `meta_info.routed_experts` is base64
    of little-endian int32 [prompt + completion - 1, layers, top_k]; row t holds the experts token t
    was routed to as the model's input, i.e. the top-k of transformers' router on a teacher-forced
    forward of prompt + output[:-1] (as a set per row: order within a row is not part of the
    contract). Not asked, no field. Parallel sampling gives each sample its own rows.
Where the backends differ (pinned, so an SGLang upgrade that changes it is noticed):
    SGLang 0.5.23 on CPU does not start with --enable-return-routed-experts: its route capturer pins
    a host buffer through torch.cuda.cudart() ("Torch not compiled with CUDA enabled"). Routes from
    SGLang need its CUDA build; on CPU the project's engine serves them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_flash.engines.client import EngineClient
from tests.contract.conftest import BACKENDS, launch_engine

SAMPLED = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}


CAPTURING = [b for b in BACKENDS if b != "sglang" or torch.cuda.is_available()]


@pytest.mark.skipif("sglang" not in BACKENDS or torch.cuda.is_available(), reason="SGLang CPU tier only")
def test_sglang_cpu_cannot_capture_routes(tiny_models, tmp_path) -> None:
    with pytest.raises(Exception, match="Torch not compiled with CUDA enabled"):
        server = launch_engine("sglang", tiny_models["qwen3_moe"], str(tmp_path),
                               sglang_args=["--enable-return-routed-experts"])
        server.stop()


@pytest.fixture(scope="module", params=CAPTURING)
def moe_engine(request: pytest.FixtureRequest, tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    server = launch_engine(request.param, tiny_models["qwen3_moe"], str(tmp_path_factory.mktemp("moe_logs")),
                           sglang_args=["--enable-return-routed-experts"])
    yield server
    server.stop()


def transformers_routes(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, top_k] top-k experts of transformers' routers, teacher-forced."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, inputs, output: got.append(output[2]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    return torch.stack(got, 1)


def as_sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(-1).values


async def _generate(url: str, prompts: list[list[int]], **kwargs) -> list:
    async with EngineClient(url) as client:
        return list(await asyncio.gather(*[client.generate(p, SAMPLED, **kwargs) for p in prompts]))


def test_routes_match_transformers_router(moe_engine) -> None:
    prompts = [[1, 20, 21, 22], [1] + list(range(5, 40)), [1, 7]]
    results = asyncio.run(_generate(moe_engine.url, prompts, return_routed_experts=True))
    for prompt, result in zip(prompts, results):
        ids = prompt + result.output_ids
        expect = transformers_routes(moe_engine.model_dir, ids[:-1])
        rows, layers, top_k = expect.shape
        assert result.routed_experts.shape == (len(ids) - 1, layers * top_k)
        got = result.routed_experts.view(rows, layers, top_k)
        assert torch.equal(as_sets(got), as_sets(expect)), f"prompt of {len(prompt)} tokens"


def test_no_routes_unless_asked(moe_engine) -> None:
    (result,) = asyncio.run(_generate(moe_engine.url, [[1, 20, 21]]))
    assert "routed_experts" not in result.meta_info and result.routed_experts is None


def test_parallel_samples_each_carry_their_routes(moe_engine) -> None:
    async def run() -> list:
        async with EngineClient(moe_engine.url) as client:
            return await client.generate_n([1, 30, 31], SAMPLED, 3, return_routed_experts=True)

    results = asyncio.run(run())
    assert len({tuple(r.output_ids) for r in results}) > 1  # temperature 1: the samples differ
    for result in results:
        ids = [1, 30, 31] + result.output_ids
        expect = transformers_routes(moe_engine.model_dir, ids[:-1])
        assert torch.equal(as_sets(result.routed_experts.view(expect.shape)), as_sets(expect))
