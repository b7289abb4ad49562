"""On-policy distillation end to end: `distill.teacher` launches a teacher engine beside the student's,
every finished response is scored by it, and the teacher logprobs the run records equal a
teacher-forced transformers forward of the teacher (fp32)."""

from __future__ import annotations

import json

import torch

from megatron_flash.ports import free_ports
from tests.e2e.test_async_pipeline import metrics, run, small_run


def hf_response_logprobs(model_dir: str, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    p = len(prompt_ids)
    return [float(logp[p - 1 + i, t]) for i, t in enumerate(response_ids)]


def test_teacher_scores_each_response_like_a_transformers_forward(tiny_models, tmp_path) -> None:
    run_dir, dump = str(tmp_path / "opd"), str(tmp_path / "groups.jsonl")
    teacher = tiny_models["qwen2"]  # another architecture and weights, the same tokenizer
    run(small_run(tiny_models["llama"], run_dir, "trainer.total_steps=2", f"distill.teacher={teacher}",
                  f"distill.base_port={free_ports(1)}", "distill.coef=0.5", f"rollout.dump_path={dump}"),
        timeout=600)
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    assert all("distill/reverse_kl" in r and r["distill/teacher_logprob"] < 0 for r in rows), rows
    with open(dump) as f:
        samples = [s for line in f for s in json.loads(line)["samples"]]
    assert samples and all(len(s["teacher_logprobs"]) == len(s["response_ids"]) for s in samples)
    worst = 0.0
    for s in samples[:6]:
        want = hf_response_logprobs(teacher, s["prompt_ids"], s["response_ids"])
        worst = max(worst, max(abs(a - b) for a, b in zip(s["teacher_logprobs"], want)))
        # the student's own logprobs are another model's: the comparison is not vacuous
        assert max(abs(a - b) for a, b in zip(s["behavior_logprobs"], want)) > 1e-3
    assert worst <= 1e-5, worst
