"""Agentic RL end to end on CPU: `launch/pretrain_async_rl.py` with `agentic.env=frozenlake`, a real
Megatron trainer, a real local engine server over HTTP and weight pushes after every step.

Checked: one metrics row per step with the env/* counters; the dumped groups (rollout.dump_path)
carry the multi-turn layout of the env manager: `response_mask` is 1 exactly on the model's tokens
(those with an engine logprob, at most max_tokens_per_turn per turn) and 0 on what the env manager
inserted (an end token after a length-cut turn, then the template's next user message + generation
prompt, which decodes to `user|map:...</s>assistant|`), so the trainer's loss mask covers the
actions only; its timeline (logging.trace) shows every env reset and step and every model turn, tagged
with its episode; and with injected env failures and hangs the episodes are counted as failed and the
run still finishes every step.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_flash.ports import free_ports
from tests.conftest import REPO, run_tool

ENV_KEYS = ("env/episodes", "env/success_rate", "env/turns_mean", "env/failed", "env/errors", "env/timeouts",
            "env/cancelled_redundant", "env/truncated", "env/invalid_actions", "env/groups_dropped")
MAX_TOKENS_PER_TURN = 2


def agentic_run(model: str, run_dir: str, *extra: str) -> list[str]:
    # The shipped agentic config with a short schedule; a random tiny model answers mostly invalid
    # (non-direction) text, which is fine: the layout and the counters are what is checked here.
    return ["launch/pretrain_async_rl.py", "--config", "configs/agentic_frozenlake_cpu.yaml",
            f"model.hf_path={model}", f"logging.dir={run_dir}", "trainer.total_steps=3",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "rollout.n_samples_per_prompt=4",
            "agentic.max_turns=3", f"agentic.max_tokens_per_turn={MAX_TOKENS_PER_TURN}",
            f"engines.base_port={free_ports(1)}", "logging.wandb_mode=disabled", "logging.tensorboard=false",
            *extra]


def run(args: list[str]) -> None:
    run_tool(args, env={"PYTHONPATH": REPO}, timeout=300)


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_agentic_run_trains_only_the_action_tokens(tiny_models, tmp_path) -> None:
    import transformers

    from megatron_flash.rollout.group_dump import read_group_dump
    from megatron_flash.types import collate

    run_dir, dump = str(tmp_path / "run"), str(tmp_path / "groups.jsonl")
    run(agentic_run(tiny_models["llama"], run_dir, f"rollout.dump_path={dump}", "logging.trace=true"))
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert sum(r["env/episodes"] for r in rows) >= 3 * 8
    for r in rows:
        for key in ENV_KEYS:
            assert key in r, key
        assert r["env/errors"] == 0 and r["env/failed"] == 0
        assert 1 <= r["env/turns_mean"] <= 3
        assert 0 < r["response_len_mean"] <= 3 * MAX_TOKENS_PER_TURN  # model tokens only
    with open(os.path.join(run_dir, "trace.json")) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in spans if e["name"] == "env step"]
    resets = [e for e in spans if e["name"] == "env reset"]
    turns = [e for e in spans if e["name"].startswith(("request", "resumed request")) and "episode" in e["args"]]
    assert len(resets) >= sum(r["env/episodes"] for r in rows)  # finished episodes, and those still running
    assert steps and all({"seed", "episode", "turn", "reward", "done"} <= set(e["args"])
                         for e in steps if "error" not in e["args"])  # (a step cancelled at the run's end)
    assert len(turns) >= len(steps)  # every env step follows a model turn

    tok = transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])
    with open(dump) as f:
        records = [json.loads(line) for line in f]
    assert records and all(len(r["samples"]) == 4 for r in records)
    assert all("response_mask" in s for r in records for s in r["samples"]), \
        "rollout.dump_path must keep Sample.response_mask (multi-turn loss mask)"
    observation = re.compile(r"^user\|(invalid )?map:[fhgp|]+</s>assistant\|$")
    for record in records:
        for s in record["samples"]:
            mask, lps, ids = s["response_mask"], s["behavior_logprobs"], s["response_ids"]
            assert len(mask) == len(ids) == len(lps) and mask[0] == 1
            segments = runs(mask)
            assert sum(v for v, _, _ in segments) <= 3  # max_turns action segments
            for value, lo, hi in segments:
                if value == 1:  # the model's reply of one turn: sampled tokens, each with its logprob
                    assert hi - lo <= MAX_TOKENS_PER_TURN
                    assert all(lp < 0 for lp in lps[lo:hi])
                    continue
                assert all(lp == 0.0 for lp in lps[lo:hi])
                inserted = ids[lo:hi]
                if ids[lo - 1] != tok.eos_token_id:  # a length-cut turn: the manager closes it
                    assert inserted[0] == tok.eos_token_id
                    inserted = inserted[1:]
                text = tok.decode(inserted, skip_special_tokens=False)
                assert observation.match(text), text

    # What the trainer sees: the loss mask of the collated batch is the response mask, nothing else.
    groups = read_group_dump(dump)
    samples = [s for g in groups for s in g.samples]
    batch = collate(samples, pad_id=tok.pad_token_id)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        expected = torch.zeros(batch.tokens.shape[1])
        expected[p:p + len(s.response_ids)] = torch.tensor(s.response_mask, dtype=torch.float32)
        assert torch.equal(batch.loss_mask[i], expected)
    assert int(batch.loss_mask.sum()) == sum(sum(s.response_mask) for s in samples)


def test_env_failures_and_hangs_are_counted_and_the_run_finishes(tiny_models, tmp_path) -> None:
    # Every env call fails with probability 0.15 or hangs with 0.05 (cut by a 1 s step timeout);
    # 2 redundant episodes per group let most groups form anyway, the rest are dropped and replaced.
    run_dir = str(tmp_path / "faults")
    run(agentic_run(tiny_models["llama"], run_dir, "agentic.redundancy=2", "agentic.step_timeout_s=1",
                    "agentic.reset_timeout_s=1",
                    "agentic.latency={failure_prob: 0.15, hang_prob: 0.05, step_latency: 0.01, seed: 3}"))
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert sum(r["env/errors"] for r in rows) > 0
    assert sum(r["env/timeouts"] for r in rows) > 0
    assert sum(r["env/failed"] for r in rows) == sum(r["env/errors"] + r["env/timeouts"] for r in rows)
    assert os.path.isfile(os.path.join(run_dir, "final_hf", "config.json"))
