"""On-policy distillation end to end: `distill.teacher` launches a teacher engine beside the student's,
every finished response is scored by it, and the teacher logprobs the run records (of the sampled
tokens, and with distill.topk its top-k tokens at each position) equal a teacher-forced transformers
forward of the teacher (fp32); the trainer's top-k reverse KL term is logged. Every distill setting but
the teacher is at its default (top-K, at the default α)."""

from __future__ import annotations

import json

import torch

from megatron_flash.config.schema import DEFAULT_DISTILL_TOPK
from megatron_flash.ports import free_ports
from tests.e2e.test_async_pipeline import metrics, run, small_run


def hf_response_logprobs(model_dir: str, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    return hf_response_scores(model_dir, prompt_ids, response_ids, 1)[0]


def hf_response_scores(model_dir: str, prompt_ids: list[int], response_ids: list[int], k: int):
    """(logprob of each response token, top-k ids, top-k logprobs at each response position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    p = len(prompt_ids)
    rows = logp[p - 1:p - 1 + len(response_ids)]
    top = rows.topk(k, dim=-1)
    return [float(rows[i, t]) for i, t in enumerate(response_ids)], top.indices.tolist(), top.values.tolist()


def test_teacher_scores_each_response_like_a_transformers_forward(tiny_models, tmp_path) -> None:
    run_dir, dump = str(tmp_path / "opd"), str(tmp_path / "groups.jsonl")
    teacher = tiny_models["qwen2"]  # another architecture and weights, the same tokenizer
    run(small_run(tiny_models["llama"], run_dir, "trainer.total_steps=2", f"distill.teacher={teacher}",
                  f"distill.base_port={free_ports(1)}", f"rollout.dump_path={dump}"),  # every other setting default
        timeout=600)
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    assert all("distill/reverse_kl" in r and r["distill/teacher_logprob"] < 0 for r in rows), rows
    assert all(r["train/distill/topk_reverse_kl"] > 0 for r in rows), rows
    with open(dump) as f:
        samples = [s for line in f for s in json.loads(line)["samples"]]
    assert samples and all(len(s["teacher_logprobs"]) == len(s["response_ids"]) == len(s["teacher_topk_ids"])
                           for s in samples)
    worst = 0.0
    for s in samples[:6]:
        want, top_ids, top_lps = hf_response_scores(teacher, s["prompt_ids"], s["response_ids"], DEFAULT_DISTILL_TOPK)
        worst = max(worst, max(abs(a - b) for a, b in zip(s["teacher_logprobs"], want)))
        assert s["teacher_topk_ids"] == top_ids
        worst = max(worst, max(abs(a - b) for got, ref in zip(s["teacher_topk_logprobs"], top_lps)
                               for a, b in zip(got, ref)))
        # the student's own logprobs are another model's: the comparison is not vacuous
        assert max(abs(a - b) for a, b in zip(s["behavior_logprobs"], want)) > 1e-3
    assert worst <= 1e-5, worst
