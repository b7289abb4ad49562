"""Agent-gateway quickstart on CPU: an OpenAI-API calculator agent, RL-trained as it is.

    OMP_NUM_THREADS=1 .venv/bin/python launch/agent_gateway_quickstart_cpu.py
    python launch/agent_gateway_quickstart_cpu.py --out runs/ag trainer.total_steps=30     # any override

Stages (each prints progress; the last line is one JSON summary):
  1. tools/make_tiny_model.py --chat → {out}/tiny_model (2 layers, hidden 64, a chat template with tools,
                                   Hermes-style tool calls, BPE merges)
  2. format-only warm-up          → Megatron SFT on whole episodes of the agent
                                   (megatron_flash/agentic/examples/calculator_agent.py), tokenised as
                                   the gateway records them: the question, a tool call with the
                                   question's expression, the tool's result, then "answer: " with the
                                   result's digits *shuffled*; loss on the model's turns only. The
                                   model learns the protocol (call the tool, then answer), not to
                                   answer with what the tool returned: success starts near chance
                                   (1/2 for a 2-digit sum, 1/3-1/6 for a 3-digit one).
  3. agentic RL                   → `launch/pretrain_async_rl.py --config configs/agentic_gateway_cpu.yaml
                                   model.hf_path={out}/warm_model`: the run serves its agent gateway, the
                                   agent (the official `openai` client) runs 8 episodes per question
                                   against it, α = 2; metrics in {out}/rl/metrics.jsonl
  4. summary                      → success rate over the first 5 vs the last 5 steps.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

from quickstart_common import REPO, Quickstart, arg_parser

CONFIG = os.path.join(REPO, "configs/agentic_gateway_cpu.yaml")


def shuffled_digits(text: str, rng: random.Random) -> str:
    digits = [c for c in text if c.isdigit()]
    rng.shuffle(digits)
    it = iter(digits)
    return "".join(next(it) if c.isdigit() else c for c in text)


def episode_sample(tokenizer: Any, question: str, rng: random.Random) -> Any:
    """One format-only episode laid out as the gateway records it (prompt, reply, the template's text
    after the reply, reply), mask 1 on the replies and their end tokens."""
    from megatron_flash.agentic.examples.calculator_agent import TOOLS, calc
    from megatron_flash.agentic.gateway.trajectory import PLACEHOLDER
    from megatron_flash.types import Sample

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    expression = question.rstrip("=?")
    args = {"expression": expression}
    call = f'<tool_call>{{"name": "calc", "arguments": {json.dumps(args)}}}</tool_call>'
    result = calc(json.dumps(args))
    answer = f"answer: {shuffled_digits(result, rng)}"
    user = {"role": "user", "content": question}
    assistant = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "calc", "arguments": args}}]}
    tool = {"role": "tool", "tool_call_id": "c0", "content": result}
    prompt = encode(render([user]))
    held = render([user, {"role": "assistant", "content": PLACEHOLDER}, tool]).split(PLACEHOLDER, 1)[1]
    eos = tokenizer.eos_token_id
    after = held[len(tokenizer.decode([eos])):]  # the reply's end token is the model's
    first, between, second = encode(call) + [eos], encode(after), encode(answer) + [eos]
    response = first + between + second
    mask = [1] * len(first) + [0] * len(between) + [1] * len(second)
    return Sample(prompt, response, [0.0] * len(response), response_mask=mask)


def summarize(rows: list[dict[str, Any]], metrics_path: str) -> dict[str, Any]:
    success = [r["env/success_rate"] for r in rows]
    k = min(5, len(rows))
    return {"rl_steps": len(rows), "success_first5": sum(success[:k]) / k, "success_last5": sum(success[-k:]) / k,
            "retokenize_mismatch": sum(r.get("gateway_retokenize_mismatch", 0) for r in rows),
            "rl_seconds_per_step": sum(r["time_step"] for r in rows) / len(rows),
            "success": [round(s, 3) for s in success], "metrics": metrics_path}


def main() -> int:
    p = arg_parser(__doc__, out="runs/agent_gateway", sft_steps=300)
    p.add_argument("--sft-batch", type=int, default=32)
    args = p.parse_args()
    run = Quickstart("gateway quickstart", out=args.out)
    tokenizer = run.tiny_model(seed=args.seed, flags=("--chat",), label="tiny chat model")
    from megatron_flash.rewards.synthetic import get_task

    task = get_task("add2")
    rng = random.Random(args.seed + 7)
    warm = run.warm_up(seed=args.seed, num_steps=args.sft_steps, batch_size=args.sft_batch,
                       make_samples=lambda: [episode_sample(tokenizer, task.make(rng)[0], rng)
                                             for _ in range(args.sft_batch)],
                       pad_id=tokenizer.pad_token_id, loss_label="nll per reply token", log_every=50)
    run.log(f"exported {warm.path}")
    summary: dict[str, Any] = {"task": "add2 via the calculator agent", "sft_steps": args.sft_steps, **warm.nll()}
    rows = run.rl(config=CONFIG, overrides=args.overrides, env={"PYTHONPATH": REPO})
    summary.update(summarize(rows, run.metrics_path))
    run.finish(summary, hide="success",
               headline="success rate: first-5-step mean {success_first5:.3f} → last-5-step mean {success_last5:.3f} "
                        "in {rl_steps} steps; {seconds} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
