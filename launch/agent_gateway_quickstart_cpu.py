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

import argparse
import json
import os
import random
import subprocess
import sys
import time
import warnings
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

CONFIG = os.path.join(REPO, "configs/agentic_gateway_cpu.yaml")


def log(msg: str) -> None:
    print(f"[gateway-quickstart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def warm_up(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.rewards.synthetic import get_task
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import collate

    task = get_task("add2")
    policy = MegatronPolicy(PolicySettings(hf_path=os.path.join(args.out, "tiny_model"), micro_batch_size=args.sft_batch,
                                           seed=args.seed, optimizer_steps=args.sft_steps,
                                           optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
    rng = random.Random(args.seed + 7)
    losses = []
    for step in range(1, args.sft_steps + 1):
        samples = [episode_sample(tokenizer, task.make(rng)[0], rng) for _ in range(args.sft_batch)]
        metrics = policy.train_step(collate(samples, pad_id=tokenizer.pad_token_id), nll_loss_fn)
        losses.append(metrics["loss"])
        if step % 50 == 0 or step == 1:
            log(f"warm-up step {step:4d}/{args.sft_steps}  nll per reply token {metrics['loss']:.3f}")
    warm = os.path.join(args.out, "warm_model")
    policy.export_hf(warm)
    log(f"exported {warm}")
    tail = losses[-10:]
    return {"sft_steps": args.sft_steps, "sft_nll_first": losses[0], "sft_nll_last": sum(tail) / len(tail)}


def rl(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    run_dir = os.path.join(args.out, "rl")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    cmd = [sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config", CONFIG,
           f"model.hf_path={os.path.join(args.out, 'warm_model')}", f"logging.dir={run_dir}", *overrides]
    log("RL: " + " ".join(cmd[1:]))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    if proc.returncode != 0:
        raise SystemExit(f"gateway quickstart: the RL run failed (exit {proc.returncode}); see the output above")
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    success = [r["env/success_rate"] for r in rows]
    k = min(5, len(rows))
    return {"rl_steps": len(rows), "success_first5": sum(success[:k]) / k, "success_last5": sum(success[-k:]) / k,
            "retokenize_mismatch": sum(r.get("gateway_retokenize_mismatch", 0) for r in rows),
            "rl_seconds_per_step": sum(r["time_step"] for r in rows) / len(rows),
            "success": [round(s, 3) for s in success], "metrics": metrics_path}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/agent_gateway")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the RL run")
    args = p.parse_args()
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    tiny = os.path.join(args.out, "tiny_model")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny, "--chat",
                        "--seed", str(args.seed)], check=True, capture_output=True)
    log(f"tiny chat model at {tiny}")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    summary: dict[str, Any] = {"task": "add2 via the calculator agent"}
    summary.update(warm_up(args, tokenizer))
    from megatron_flash.trainer.distributed import destroy_distributed

    destroy_distributed()
    summary.update(rl(args, args.overrides))
    summary["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"success rate: first-5-step mean {summary['success_first5']:.3f} → last-5-step mean "
        f"{summary['success_last5']:.3f} in {summary['rl_steps']} steps; {summary['seconds']} s total")
    print(json.dumps({k: v for k, v in summary.items() if k != "success"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
