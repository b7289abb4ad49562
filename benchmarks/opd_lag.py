"""On-policy distillation outside the product: which KL survives stale samples (plain torch + HF).

    OMP_NUM_THREADS=1 python benchmarks/opd_lag.py --estimator sampled --lag 2
    OMP_NUM_THREADS=1 python benchmarks/opd_lag.py --estimator full --lag 2
    OMP_NUM_THREADS=1 python benchmarks/opd_lag.py --estimator topk --k 4 --lag 2

The same teacher and student as benchmarks/distill.py (built there and cached under
runs/bench_models), the quickstart's budget (16 prompts × 8 samples per step, Adam lr 1e-3), but no
engines, no asynchrony machinery: each step samples with HF `generate` from a copy of the student
holding the weights of --lag updates before (every sample exactly that stale; 0 = on-policy), then
takes one Adam step on

  sampled   −sg(min(π_θ/μ, 1)) · Â_t · log π_θ(y_t), Â_t = −(log π_θ(y_t) − log π_teacher(y_t)) at the
            sampled token (the product's distill.mode=only with tis)
  full      Σ_v π_θ(v | s_t)(log π_θ(v | s_t) − log π_teacher(v | s_t)) over the whole vocabulary at each
            visited state s_t (the reverse KL itself, no sampling of the next token)
  topk      the same KL over the teacher's --k most likely tokens plus one bucket for the rest of the
            vocabulary (what an engine's top-K logprobs allow; the product's distill.topk)

averaged over the response tokens. Prints the task reward (exact sort) of each step's samples, the
response length and the sampled-token KL; the last line is a JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_flash.rewards.synthetic import get_task  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "bench_models")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimator", choices=("sampled", "full", "topk"), required=True)
    p.add_argument("--k", type=int, default=4, help="teacher tokens kept per position (--estimator topk)")
    p.add_argument("--lag", type=int, default=2, help="updates between the sampling weights and the trained ones")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--teacher", default=os.path.join(MODELS, "sort4_teacher_s0_60", "final_hf"))
    p.add_argument("--student", default=os.path.join(MODELS, "sort4_quickstart_s0", "warm_model"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for path in (args.teacher, args.student):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"no model at {path}: run benchmarks/distill.py once to build the teacher and student")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    sampler = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).eval()
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    history = [copy.deepcopy(student.state_dict()) for _ in range(args.lag + 1)]
    task, rng, eos = get_task("sort4"), random.Random(args.seed + 1), tok.eos_token_id
    rewards: list[float] = []
    for step in range(args.steps):
        sampler.load_state_dict(history[0])  # the weights of `lag` updates ago
        seqs, starts, hits = [], [], []
        with torch.no_grad():
            for prompt, answer in (task.make(rng) for _ in range(16)):
                ids = tok(prompt)["input_ids"]
                out = sampler.generate(torch.tensor([ids] * 8), max_new_tokens=8, do_sample=True, top_k=0,
                                       top_p=1.0, pad_token_id=eos, attention_mask=torch.ones(8, len(ids)))
                for row in out.tolist():
                    resp = row[len(ids):]
                    resp = resp[:resp.index(eos) + 1] if eos in resp else resp
                    seqs.append(ids + resp)
                    starts.append(len(ids))
                    hits.append(float(bool(resp) and resp[-1] == eos and tok.decode(resp[:-1]) == answer))
        width = max(map(len, seqs))
        x = torch.full((len(seqs), width), eos)
        mask = torch.zeros(len(seqs), width)
        for i, (q, start) in enumerate(zip(seqs, starts)):
            x[i, :len(q)] = torch.tensor(q)
            mask[i, start:len(q)] = 1
        target, mask = x[:, 1:], mask[:, 1:]
        with torch.no_grad():
            log_t = torch.log_softmax(teacher(x).logits[:, :-1].float(), -1)
            log_mu = torch.log_softmax(sampler(x).logits[:, :-1].float(), -1).gather(-1, target[..., None])[..., 0]
        log_s = torch.log_softmax(student(x).logits[:, :-1].float(), -1)
        lp = log_s.gather(-1, target[..., None])[..., 0]
        k = lp.detach() - log_t.gather(-1, target[..., None])[..., 0]
        if args.estimator == "full":
            per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
        elif args.estimator == "topk":
            t_top, ids = log_t.topk(args.k, dim=-1)
            s_top = log_s.gather(-1, ids)
            rest = lambda lp: torch.log(-torch.expm1(torch.logsumexp(lp, -1).clamp(max=-1e-6)))  # noqa: E731
            per_token = (s_top.exp() * (s_top - t_top)).sum(-1) + rest(s_top).exp() * (rest(s_top) - rest(t_top))
        else:
            weight = torch.exp(lp.detach() - log_mu).clamp(max=1.0)
            per_token = -weight * (-k) * lp
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history = history[1:] + [copy.deepcopy(student.state_dict())]
        rewards.append(statistics.fmean(hits))
        print(f"step {step}: reward {rewards[-1]:.3f} length {mask.sum().item() / len(seqs):.2f} "
              f"sampled-token KL {(k * mask).sum().item() / mask.sum().item():.2f}", flush=True)
    print(json.dumps({"estimator": args.estimator, **({"k": args.k} if args.estimator == "topk" else {}), "lag": args.lag, "lr": args.lr, "steps": args.steps,
                      "final_reward": round(statistics.fmean(rewards[-5:]), 4), "rewards": [round(r, 3) for r in rewards]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
