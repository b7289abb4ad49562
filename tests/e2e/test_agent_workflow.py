"""`agentic.workflow`: an agent written with the `openai` client, trained through the run's gateway.

`launch/pretrain_async_rl.py` with the tiny chat model, agentic.workflow=tests.e2e.toy_agents:two_turns_flaky
(two model calls per episode; some episodes hang, some raise), α = 2, no redundancy. Checked: the run
trains to the end; hung episodes end at agentic.workflow_timeout_s and failing ones are counted, their
groups are dropped and replaced; every trained sample is one episode laid out as the gateway recorded it
(the prompt is the chat template of the task's question, the response holds both replies with mask
1 and the template's text between them with mask 0), checked by re-rendering it independently.
"""

from __future__ import annotations

import json
import os

import transformers

from megatron_flash.ports import free_ports
from tests.conftest import REPO, run_tool


def test_openai_agent_episodes_train(tmp_path) -> None:
    model = str(tmp_path / "chat")
    run_tool(["tools/make_tiny_model.py", "--out", model, "--chat"])
    run_dir, dump = str(tmp_path / "run"), str(tmp_path / "groups.jsonl")
    run_tool(["launch/pretrain_async_rl.py", "--config", "configs/agentic_gateway_cpu.yaml", f"model.hf_path={model}",
              f"logging.dir={run_dir}", "trainer.total_steps=3", "trainer.global_batch_size=16",
              "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4", f"engines.base_port={free_ports(1)}",
              "agentic.workflow=tests.e2e.toy_agents:two_turns_flaky",
              "agentic.workflow_timeout_s=3", f"rollout.dump_path={dump}", "logging.wandb_mode=disabled",
              "logging.tensorboard=false"], env={"PYTHONPATH": REPO}, timeout=600)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    total = {k: sum(r.get(k, 0) for r in rows)
             for k in ("env/timeouts", "env/workflow_errors", "env/episodes", "env/groups_dropped")}
    assert total["env/timeouts"] >= 1 and total["env/workflow_errors"] >= 1 and total["env/episodes"] >= 48
    assert total["env/groups_dropped"] >= 2  # no redundancy: a failed episode drops its group, the run goes on
    assert all(r["env/turns_mean"] == 2 for r in rows if r["env/episodes"])
    assert max(r["staleness_max"] for r in rows) <= 2  # α = 2 (the config's default) holds for agent episodes

    tok = transformers.AutoTokenizer.from_pretrained(model)
    with open(dump) as f:
        groups = [json.loads(line) for line in f if line.strip()]
    assert groups
    for group in groups:
        assert len(group["samples"]) == 4
        for s in group["samples"]:
            mask = s["response_mask"]
            assert mask[0] == 1 and 0 in mask and mask[-1] == 1
            prompt = tok.decode(s["prompt_ids"])
            assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
            zero_run = [t for t, m in zip(s["response_ids"], mask) if m == 0]
            between = tok.decode(zero_run)  # what the gateway put between the two replies
            assert between.endswith("<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"), between


def test_the_calculator_demo_calls_its_tool_and_trains(tmp_path) -> None:
    """The demo (`launch/agent_gateway_quickstart_cpu.py`: the official-client calculator agent) with a
    short warm-up: the model's tool calls are parsed into OpenAI tool_calls, the agent answers them
    with tool messages and the model answers again (two model calls per episode on average > 1), and
    the steps train on the episodes' sampled tokens."""
    out = str(tmp_path / "demo")
    proc = run_tool(["launch/agent_gateway_quickstart_cpu.py", "--out", out, "--sft-steps", "150",
                     "trainer.total_steps=3", f"engines.base_port={free_ports(1)}", "logging.wandb_mode=disabled",
                     "logging.tensorboard=false"], env={"PYTHONPATH": REPO}, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rl_steps"] == 3
    with open(os.path.join(out, "rl", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    turns = [r["env/turns_mean"] for r in rows if r["env/episodes"]]
    assert turns and max(turns) > 1.2  # tool call → tool result → answer, through the real parser
    assert all(r["train/num_trained_tokens"] > 0 for r in rows)  # the episodes' sampled tokens train
