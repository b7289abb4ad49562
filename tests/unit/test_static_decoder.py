"""The local engine's static decoder (slot KV cache, packed prefill, one decode step for all running
requests) on CPU, checked against transformers' own forward of the same checkpoint with its default
attention: every reported logprob equals the teacher-forced log_softmax(logits / T) of that token
(≤ 1e-4 in fp32), greedy tokens are the teacher-forced argmax, for each model family the engine serves.
Requests of different lengths run together (rows and length buckets differ per step), identical prompts
share one prefill, and a seeded request draws the same tokens alone or in a crowd."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_flash.engines.local_engine import LocalEngine
from megatron_flash.engines.sampling import SamplingSpec
from megatron_flash.engines.static_decoder import bucket

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")


def run(engine: LocalEngine, jobs: list[tuple[list[int], dict]]) -> list:
    async def go() -> list:
        reqs = []
        for i, (prompt, params) in enumerate(jobs):
            spec = SamplingSpec.from_json(params, vocab_size=engine.vocab_size)
            reqs.append(await engine.admit(rid=f"r{i}", prompt_ids=prompt, spec=spec))
        for req in reqs:
            await asyncio.wait_for(req.done.wait(), 60)
            engine.release(req)
        return reqs
    return asyncio.run(go())


def teacher_forced(model_path: str, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_greedy_tokens_match_a_teacher_forced_forward(arch: str, tiny_models: dict) -> None:
    engine = LocalEngine(model_path=tiny_models[arch], decoder="static", seed=0, max_running_requests=8)
    try:
        g = torch.Generator().manual_seed(3)
        jobs = []
        for i in range(6):  # prompts of 3..70 tokens: rows 1..8 and length buckets 64 and 128 both occur
            length = [3, 9, 70, 5, 33, 12][i]
            prompt = torch.randint(3, engine.vocab_size, (length,), generator=g).tolist()
            params = ({"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True} if i % 2 == 0 else
                      {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True})
            jobs.append((prompt, params))
        reqs = run(engine, jobs)
    finally:
        engine.shutdown()
    for req, (prompt, params) in zip(reqs, jobs):
        assert req.finish == {"type": "length", "length": 20} and len(req.output_ids) == 20
        temperature = params["temperature"] or 1.0
        reference = teacher_forced(tiny_models[arch], prompt, req.output_ids, temperature)
        picked = reference.gather(1, torch.tensor(req.output_ids).view(-1, 1))[:, 0]
        torch.testing.assert_close(torch.tensor(req.logprobs, dtype=torch.float64), picked, atol=1e-4, rtol=0)
        if params["temperature"] == 0.0:
            assert req.output_ids == reference.argmax(-1).tolist()


def test_shared_prompts_and_seeds_give_the_tokens_of_a_lone_request(tiny_models: dict) -> None:
    prompt = [5, 9, 11, 4, 7]
    seeded = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 77, "ignore_eos": True}
    engine = LocalEngine(model_path=tiny_models["qwen2"], decoder="static", seed=0, max_running_requests=8)
    try:
        alone = run(engine, [(prompt, seeded)])[0].output_ids
        crowd = run(engine, [(prompt, {**seeded, "sampling_seed": s}) for s in (1, 2, 77, 3)]
                    + [([8, 8, 8], seeded), (prompt, {"max_new_tokens": 4, "temperature": 0.0})])
    finally:
        engine.shutdown()
    assert crowd[2].output_ids == alone
    assert crowd[0].output_ids != alone  # another seed, another draw (16 tokens of a 48-token vocabulary)
    assert crowd[4].output_ids != alone  # another prompt


def test_buckets_are_powers_of_two_above_a_floor_and_capped() -> None:
    assert bucket(1, 64) == 1 and bucket(3, 64) == 4 and bucket(65, 64) == 64
    assert bucket(1, 256, 64) == 64 and bucket(65, 256, 64) == 128 and bucket(300, 256, 64) == 256


def test_stop_ids_are_masked_until_min_new_tokens(tiny_models: dict) -> None:
    engine = LocalEngine(model_path=tiny_models["llama"], decoder="static", seed=0)
    try:
        probe = run(engine, [([5, 6, 7], {"max_new_tokens": 6, "temperature": 0.0})])[0]
        stop = probe.output_ids[0]  # the greedy first token, made a stop id
        reqs = run(engine, [([5, 6, 7], {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [stop]}),
                            ([5, 6, 7], {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [stop],
                                         "min_new_tokens": 3})])
    finally:
        engine.shutdown()
    assert reqs[0].output_ids == [stop] and reqs[0].finish == {"type": "stop", "matched": stop}
    assert stop not in reqs[1].output_ids[:3] and len(reqs[1].output_ids) >= 3
