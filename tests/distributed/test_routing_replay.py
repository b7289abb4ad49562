"""Rollout routing replay (R3) on real engine samples: the local engine generates from the tiny
Qwen3-MoE over HTTP and returns its routes; the trainer (one process; TP2 × SP × EP2 over four)
scores the samples with its routers as loaded and with them perturbed, replay off and on.

What must hold, and why it is exact where it is asserted exactly:
  same weights     routing agrees with the engine on every (token, layer) and the logprobs match
                   (≤ 1e-4, fp32), replay on or off
  perturbed, off   the trainer's own top-k differs from the engine's (agreement < 1) and so do the
                   logprobs
  perturbed, on    the routers *use* the engine's experts on every (token, layer) (replayed = 1.0)
                   although their own top-k still differs; the logprob gap shrinks but does not
                   vanish: replay fixes which experts, while the gate weights come from the trainer's
                   (perturbed) router scores, as Megatron's replay and R3 intend (the router trains)
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_flash.engines.client import EngineClient
from tests.conftest import run_tool
from tests.contract.conftest import launch_engine


@pytest.fixture(scope="module")
def engine_samples(tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six samples of the tiny MoE with routes, from the local engine over HTTP, saved for the workers."""
    model = tiny_models["qwen3_moe"]
    root = tmp_path_factory.mktemp("replay")
    server = launch_engine("cpu", model, str(root))
    try:
        async def run() -> list:
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(4, 46, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 4)]
            async with EngineClient(server.url) as client:
                results = await asyncio.gather(*[client.generate(p, {"max_new_tokens": 10, "temperature": 1.0},
                                                                 return_routed_experts=True) for p in prompts])
            return [dict(prompt_ids=p, response_ids=r.output_ids, behavior_logprobs=r.output_logprobs,
                         routed_experts=r.routed_experts) for p, r in zip(prompts, results)]
        records = asyncio.run(run())
    finally:
        server.stop()
    path = str(root / "samples.pt")
    torch.save(records, path)
    return path


@pytest.mark.parametrize("layout", ["tp1-packed", "tp1-padded", "tp2-sp-ep2"])
def test_replay_uses_the_engine_routes(tiny_models, engine_samples: str, layout: str) -> None:
    tp, ep, nproc = (2, 2, 4) if layout == "tp2-sp-ep2" else (1, 1, 1)
    pack = "nopack" if layout == "tp1-padded" else "pack"
    proc = run_tool(["tests/distributed/routing_replay_worker.py", tiny_models["qwen3_moe"], engine_samples,
                     str(tp), str(ep), pack], nproc=nproc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("off", "on"):
        same = out["plain"][mode]
        assert same["moe_route_agreement"] == 1.0 and same["moe_route_replayed"] == 1.0
        assert same["max_diff"] <= 1e-4
    off, on = out["perturbed"]["off"], out["perturbed"]["on"]
    assert off["moe_route_agreement"] < 0.95 and off["moe_route_replayed"] == off["moe_route_agreement"]
    assert off["max_diff"] > 1e-2
    assert on["moe_route_replayed"] == 1.0 and on["moe_route_agreement"] < 0.95
    assert on["mean_diff"] < off["mean_diff"]
