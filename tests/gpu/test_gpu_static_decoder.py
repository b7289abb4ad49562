"""The local engine's static decoder on CUDA: decode steps replayed from CUDA graphs give the tokens and
logprobs of the same steps run eagerly (fp32: greedy tokens equal, logprobs within 1e-4), and in bf16 the
logprobs sit within bf16 tolerance of a teacher-forced fp32 transformers forward; graphed steps are
counted in step_profile. Requests of several lengths run together, so several (rows, length) graphs are
captured and replayed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.unit.test_static_decoder import teacher_forced


def _generate(model_path: str, *, dtype: str, cuda_graphs: bool, jobs: list) -> tuple[list, dict]:
    from megatron_flash.engines.local_engine import LocalEngine
    from megatron_flash.engines.sampling import SamplingSpec

    engine = LocalEngine(model_path=model_path, decoder="static", device="cuda", dtype=dtype, seed=0,
                         max_running_requests=8, cuda_graphs=cuda_graphs)

    async def go() -> list:
        reqs = []
        for i, (prompt, params) in enumerate(jobs):
            reqs.append(await engine.admit(rid=f"r{i}", prompt_ids=prompt,
                                           spec=SamplingSpec.from_json(params, vocab_size=engine.vocab_size)))
        for req in reqs:
            await asyncio.wait_for(req.done.wait(), 120)
        return reqs
    try:
        reqs = asyncio.run(go())
        profile = engine.step_profile.snapshot()
    finally:
        engine.shutdown()
    return [(r.output_ids, r.logprobs) for r in reqs], profile


def _jobs() -> list:
    g = torch.Generator().manual_seed(5)
    jobs = []
    for i, length in enumerate([3, 40, 9, 70, 5]):
        prompt = torch.randint(3, 48, (length,), generator=g).tolist()
        params = {"max_new_tokens": 24, "ignore_eos": True}
        params.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "sampling_seed": i})
        jobs.append((prompt, params))
    return jobs


@pytest.mark.gpu(1)
def test_graph_replays_equal_eager_steps_in_fp32(tiny_models: dict) -> None:
    jobs = _jobs()
    graphed, profile = _generate(tiny_models["qwen2"], dtype="float32", cuda_graphs=True, jobs=jobs)
    eager, eager_profile = _generate(tiny_models["qwen2"], dtype="float32", cuda_graphs=False, jobs=jobs)
    assert profile["graphed_steps"] > 0 and eager_profile["graphed_steps"] == 0, (profile, eager_profile)
    for (g_ids, g_lps), (e_ids, e_lps), (_, params) in zip(graphed, eager, jobs):
        if params["temperature"] == 0.0:
            assert g_ids == e_ids
        n = next((i for i, (a, b) in enumerate(zip(g_ids, e_ids)) if a != b), len(g_ids))
        torch.testing.assert_close(torch.tensor(g_lps[:n]), torch.tensor(e_lps[:n]), atol=1e-4, rtol=0)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_logprobs_match_a_teacher_forced_forward(arch: str, tiny_models: dict) -> None:
    jobs = _jobs()
    outs, profile = _generate(tiny_models[arch], dtype="bfloat16", cuda_graphs=True, jobs=jobs)
    assert profile["graphed_steps"] > 0
    for (ids, lps), (prompt, params) in zip(outs, jobs):
        reference = teacher_forced(tiny_models[arch], prompt, ids, params["temperature"] or 1.0)
        picked = reference.gather(1, torch.tensor(ids).view(-1, 1))[:, 0]
        assert float((torch.tensor(lps, dtype=torch.float64) - picked).abs().mean()) < 2e-2
