"""The product's entry point end to end on CPU: `launch/pretrain_async_rl.py` with a real Megatron
trainer (gloo), a real local engine server over HTTP, real weight pushes after every step.

Checked: the run finishes with exit 0, one metrics row per step with the documented keys, policy
versions 1..N, staleness within α (and exactly 0 for α = 0), the engine's behavior logprobs equal
the trainer's for fresh samples (train/inference parity through the pushes), the final HF export
differs from the start, rollout-only dumps replay in train-only mode, and bad input fails clearly.
The α runs also write their timeline (logging.trace): it parses, spans nest per row, the engine's
request spans are exactly the requests each metrics window counted, generation overlaps training at
α = 2 and never at α = 0 (and pipeline/overlap says the same), admission/sit_s of each step matches
the trace's put-to-take times of the groups it trained; tools/report.py builds from the α = 2 run.
Runs without logging.trace write no trace.
"""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from megatron_flash.ports import free_ports
from tests.conftest import run_tool

REQUIRED = ("step", "reward_mean", "response_len_mean", "staleness_mean", "staleness_max", "dropped_stale",
            "engine_idle_frac", "time_rollout_wait", "time_train", "time_sync", "tokens_per_s",
            "train_infer_logprob_diff")


def small_run(model: str, run_dir: str, *extra: str) -> list[str]:
    return ["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml", f"model.hf_path={model}",
            f"logging.dir={run_dir}", "trainer.total_steps=4", "trainer.global_batch_size=16",
            "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4", f"engines.base_port={free_ports(1)}",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "loss.name=decoupled_ppo",
            "rollout.reward=tests.e2e.toy_rewards:digit_fraction", *extra]


def run(args: list[str], **kwargs):
    from tests.conftest import REPO

    return run_tool(args, env={"PYTHONPATH": REPO}, **kwargs)


def load_dir(path: str) -> dict:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def check_trace(run_dir: str, rows: list[dict], *, alpha: int) -> None:
    with open(os.path.join(run_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    rows_of: dict = {}
    for e in spans:  # one row's spans nest (the viewers need it): never a partial overlap
        rows_of.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for row in rows_of.values():
        open_ends: list[float] = []
        for start, end in sorted(row, key=lambda x: (x[0], -x[1])):
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, (start, end, open_ends)
            open_ends.append(end)
    assert [e["name"] for e in spans if e["name"].startswith("step ")] == [f"step {r['step']}" for r in rows]
    assert {"batch wait", "train", "optimizer step", "weight push", "pause", "buckets", "resume", "probe",
            "reward"} <= {e["name"] for e in spans}
    requests = [e for e in spans if tracks[e["pid"]] == "engine 0"]
    assert requests and all(e["name"].startswith(("request", "resumed request")) for e in requests)
    assert all("prompt" in e["args"] and "version_start" in e["args"] for e in requests)
    # each metrics window counted exactly the replies the trace puts between its mark and the one before
    marks = [e["ts"] for e in events if e["name"] == "metrics window"]
    assert len(marks) == len(rows)
    replied = [e["ts"] + e["dur"] for e in requests if e["args"]["finish"] not in ("error", "cancelled")]
    for r, lo, hi in zip(rows, [float("-inf")] + marks, marks):
        assert sum(lo < end <= hi for end in replied) == r["engine0_requests"], r["step"]
    trains = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "train"]
    overlapping = [e for e in requests if any(e["ts"] < b and e["ts"] + e["dur"] > a for a, b in trains)]
    if alpha == 0:  # generation and training alternate: by construction, not by luck
        assert not overlapping and all(r["pipeline/overlap"] == 0 for r in rows)
    else:
        assert overlapping and max(r["pipeline/overlap"] for r in rows) > 0
    assert all(0 <= r["pipeline/overlap"] <= 1 for r in rows)


def check_admission(run_dir: str, rows: list[dict], *, alpha: int) -> None:
    """The admission metrics against the trace: admission/sit_s of each step is the mean time from the
    `put` of each trained group (trained_prompts.jsonl names them) to the step's `take`; the default
    tokens lookahead stays within [min(1, α), α]; a late share needs a wait."""
    with open(os.path.join(run_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    put_at = {e["args"]["prompt"]: e["ts"] for e in events if e["name"] == "put"}
    takes = sorted(e["ts"] for e in events if e["name"] == "take")
    with open(os.path.join(run_dir, "trained_prompts.jsonl")) as f:
        trained = [json.loads(line)["prompt_indices"] for line in f if line.strip()]
    assert len(takes) == len(trained) == len(rows)
    for r, take, prompts in zip(rows, takes, trained):
        sat = sum(take - put_at[p] for p in prompts) / len(prompts) / 1e6  # equal groups: the sample mean
        assert abs(r["admission/sit_s"] - sat) <= 0.05, (r["step"], r["admission/sit_s"], sat)
        assert min(1, alpha) <= r["rollout_lookahead"] <= alpha
        assert 0 <= r["admission/late_share"] <= 1 and r["admission/starved_s"] >= 0
        assert r["admission/late_share"] == 0 or r["time_rollout_wait"] > 0, r


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("alpha", [0, 2])
def test_async_run_end_to_end(tiny_models, tmp_path, alpha: int) -> None:
    run_dir = str(tmp_path / "run")
    # α = 2 also runs DAPO's overlong shaping and filtering (the quickstart's responses often hit the limit)
    overlong = ["rollout.overlong_buffer_len=4", "rollout.overlong_filter=true"] if alpha else []
    run(small_run(tiny_models["llama"], run_dir, f"async_rl.alpha={alpha}", "logging.trace=true", *overlong),
        timeout=600)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert 0 <= r["staleness_max"] <= alpha
        assert r["dropped_stale"] == 0
        assert 0.0 <= r["engine_idle_frac"] <= 1.0 and r["tokens_per_s"] > 0
        # Fresh samples were generated by the engine with exactly the trainer's weights (fp32).
        if r.get("train_infer_logprob_diff") is not None:
            assert r["train_infer_logprob_diff"] <= 1e-4, r
        if r["mismatch_k3"] is not None:  # fresh samples (version = the trainer's): the same fp32 weights
            assert 0 <= r["mismatch_k3"] <= 1e-8 and abs(r["mismatch_log_ppl_gap"]) <= 1e-4, r
        truncated = round(r["overlong_frac"] * 16)
        if alpha:  # every truncated response left the loss (unless all 16 were), and was penalised
            assert r["overlong_filtered"] == (0 if r["overlong_filter_skipped"] else truncated), r
            assert "overlong_penalized" in r and "overlong_penalty_mean" in r
        else:
            assert r["overlong_filtered"] == 0 and "overlong_penalized" not in r
    if alpha == 0:
        assert all(r["staleness_mean"] == 0 for r in rows)
        assert all(r["mismatch_k3"] is not None for r in rows)  # every sample is fresh at α = 0
    else:
        assert sum(r["overlong_filtered"] for r in rows) > 0, rows  # the case was exercised
    start = load_dir(tiny_models["llama"])
    final = load_dir(os.path.join(run_dir, "final_hf"))
    assert set(start) == set(final)
    assert any((start[k] - final[k]).abs().max() > 0 for k in start)  # it trained
    assert sum(v for r in rows for k, v in r.items() if k.startswith("staleness/samples_")) == 16 * len(rows)
    check_trace(run_dir, rows, alpha=alpha)
    check_admission(run_dir, rows, alpha=alpha)
    if alpha:
        from tools.report import SECTIONS, build_report

        page = build_report(run_dir)
        assert all(f"<section id='{name}'>" in page for name in SECTIONS)
        assert page.count("data:image/png;base64,") == len(SECTIONS) - 3  # no eval, MFU null on CPU, config


def test_tensor_parallel_trainer_under_torchrun(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "tp2")
    run(small_run(tiny_models["llama"], run_dir, "parallel.tensor_model_parallel_size=2",
                       "trainer.total_steps=2", "trainer.version_check_interval=1"), nproc=2, timeout=900)
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2]
    assert not [f for f in os.listdir(run_dir) if f.startswith("trace")]  # logging.trace is off by default
    assert all(r["train_infer_logprob_diff"] <= 1e-4 for r in rows if r.get("train_infer_logprob_diff") is not None)
    # the labelled-version check on a sharded trainer: weights swapped per rank, the forward collective
    assert all(r["mismatch_labelled_tokens"] > 0 and r["mismatch_labelled_max"] <= 1e-5 for r in rows), rows


def test_rollout_only_dump_replays_in_train_only(tiny_models, tmp_path) -> None:
    """A rollout-only dump replayed by train-only runs; the replay with trainer.shared_prefix=true (each
    group's prompt once) gives the same loss at every one of 10 steps (π_prox recomputed through the
    shared layout too) while computing fewer tokens."""
    dump = str(tmp_path / "groups.jsonl")
    run(small_run(tiny_models["llama"], str(tmp_path / "ro"), "trainer.mode=rollout_only",
                       f"rollout.dump_path={dump}", "trainer.total_steps=10"), timeout=600)
    with open(dump) as f:
        groups = [json.loads(line) for line in f]
    assert len(groups) >= 40 and all(len(g["samples"]) == 4 for g in groups)
    s = groups[0]["samples"][0]
    assert len(s["response_ids"]) == len(s["behavior_logprobs"]) > 0
    runs = {}
    for shared in (False, True):
        run_dir = runs[shared] = str(tmp_path / ("to_shared" if shared else "to"))
        run(small_run(tiny_models["llama"], run_dir, "trainer.mode=train_only", f"trainer.replay_path={dump}",
                      "trainer.total_steps=10", f"trainer.shared_prefix={str(shared).lower()}"), timeout=600)
    plain, shared = metrics(runs[False]), metrics(runs[True])
    assert [r["version"] for r in plain] == [r["version"] for r in shared] == list(range(1, 11))
    for a, b in zip(plain, shared):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-6, (a["train/loss"], b["train/loss"])
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5, abs=1e-7)
        assert b["train/tokens_computed"] < a["train/tokens_computed"]
        # the rows hold no padding here: what was not recomputed is what the shared layout dropped
        saved = 1 - b["train/tokens_computed"] / a["train/tokens_computed"]
        assert b["train/shared_prefix_saved_frac"] == pytest.approx(saved, rel=1e-6), (b, a)
        assert "train/shared_prefix_saved_frac" not in a
    assert any(r["train/loss"] != 0 for r in plain)
    for d in (runs[False], str(tmp_path / "ro")):  # logging.trace off: nothing written
        assert not [f for f in os.listdir(d) if f.startswith("trace")], os.listdir(d)


def test_missing_dataset_fails_naming_the_key(tiny_models, tmp_path) -> None:
    proc = run(small_run(tiny_models["llama"], str(tmp_path / "bad"), f"data.path={tmp_path}/nope.jsonl"),
                    timeout=300, check=False)
    assert proc.returncode != 0
    assert "data.path" in proc.stderr and "nope.jsonl" in proc.stderr, proc.stderr[-2000:]


def test_pause_mode_abort_resumes_and_a_raising_reward_is_counted(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "abort")
    # loss.prox_logprobs=approximate: π_prox from the training forward on resumed samples (tokens of two versions)
    run(small_run(tiny_models["llama"], run_dir, "rollout.pause_mode=abort", "async_rl.alpha=1",
                  "rollout.reward=tests.e2e.toy_rewards:flaky_digit_fraction", "trainer.total_steps=6",
                  "rollout.max_new_tokens=24", "trainer.max_seq_len=40", "logging.trace=true",
                  "loss.prox_logprobs=approximate"), timeout=600)
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert rows[-1]["reward_failed"] > 0  # the toy reward raised for some samples; the run went on
    assert sum(r["rollout_resumes"] for r in rows) > 0  # pushes aborted requests; they resumed
    with open(os.path.join(run_dir, "trace.json")) as f:  # and the timeline shows them as such
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    aborted = [e for e in spans if e["name"] == "request abort"]
    resumed = [e for e in spans if e["name"].startswith("resumed request")]
    assert aborted and resumed and all(e["args"]["resume"] >= 1 for e in resumed)
    def sample(e: dict) -> str:  # rid g{group}-s{sample}-r{resume}
        return e["args"]["rid"].rsplit("-r", 1)[0]

    assert {sample(e) for e in resumed} <= {sample(e) for e in aborted}  # each continues an aborted request
    assert any(e["name"] == "reward" and "error" not in e["args"] and e["args"].get("failed") for e in spans)


def test_engines_down_stops_with_a_clear_error_and_saves(tiny_models, tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO
    from tests.contract.conftest import launch_engine

    server = launch_engine("cpu", tiny_models["llama"], str(tmp_path))
    run_dir = str(tmp_path / "down")
    args = small_run(tiny_models["llama"], run_dir, "engines.backend=attach", f"engines.urls=[{server.url}]",
                     "trainer.total_steps=500", "engines.down_timeout_s=10")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
                                               or len(metrics(run_dir)) < 2):
            time.sleep(0.2)
        assert len(metrics(run_dir)) >= 2, "the run never got going"
        server.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=180)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode not in (0, None)
    assert server.url in err or "engine" in err.lower(), err[-3000:]
    saved = [d for d in os.listdir(run_dir) if d.startswith("hf_at_stop_v")]
    assert saved, os.listdir(run_dir)
    print(f"stopped {took:.1f} s after the engine died; saved {saved}; last error line: {err.strip().splitlines()[-1]}")


def test_evaluation_is_pinned_to_one_version_and_runs_standalone(tiny_models, tmp_path) -> None:
    """α = 2, rollout running beside: evaluations at steps 0, 2, 4 each see exactly the version the
    trainer had pushed (every reply checked), never an aborted request; then launch/evaluate.py scores
    the final checkpoint the same way on its own."""
    run_dir = str(tmp_path / "eval")
    evals = ["eval.datasets={sort4: {task: sort4, num_samples: 6}}", "eval.every_steps=2", "eval.n_samples=4"]
    run(small_run(tiny_models["llama"], run_dir, "async_rl.alpha=2", *evals), timeout=600)
    with open(os.path.join(run_dir, "eval.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["version"]) for r in rows] == [(0, 0), (2, 2), (4, 4)]
    for r in rows:
        assert r["eval/sort4/off_version"] == 0 and r["eval/sort4/aborted"] == 0, r
        assert r["eval/sort4/num_prompts"] == 6 and 0 <= r["eval/sort4/pass@1"] <= r["eval/sort4/pass@4"] <= 1
    with open(os.path.join(run_dir, "eval_samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 3 * 6 * 4
    # the engines' start label before the first push, then the pushed version, on every reply
    assert all(s["weight_version"] == (str(s["version"]) if s["version"] else "default") for s in samples)
    # pass@1 recomputed from the samples (reward 1 = correct for sort4's exact match)
    first = [s for s in samples if s["step"] == 0]
    assert rows[0]["eval/sort4/pass@1"] == pytest.approx(sum(s["reward"] >= 1 for s in first) / len(first))

    out = str(tmp_path / "standalone")
    proc = run(["launch/evaluate.py", "--config", "configs/quickstart_cpu.yaml",
                f"model.hf_path={os.path.join(run_dir, 'final_hf')}", f"logging.dir={out}",
                f"engines.base_port={free_ports(1)}", "logging.wandb_mode=disabled", *evals], timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["eval/sort4/num_prompts"] == 6 and row["eval/sort4/off_version"] == 0
    assert os.path.isfile(os.path.join(out, "eval.jsonl"))


def test_a_prompt_longer_than_the_engine_context_is_skipped_not_retried(tiny_models, tmp_path) -> None:
    """A user's first run: a four-row file, one prompt longer than the engine's context (it used to be
    re-queued forever on the engine's 400). The engines' context is read at start: the prompt is
    skipped at load and counted, the run trains on the other three and finishes. (A refusal the check
    cannot foresee — an engine that reports no context — is skipped on the engine's 4xx instead:
    tests/unit/test_async_scheduler.py.)"""
    data = tmp_path / "rows.jsonl"
    rows = [{"question": "1 2 3", "answer": "123"}, {"question": "4 5", "answer": "45"},
            {"question": " ".join(["7"] * 200), "answer": "7"}, {"question": "8 9", "answer": "89"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = str(tmp_path / "long")
    run(small_run(tiny_models["llama"], run_dir, f"data.path={data}", "data.task=", "data.prompt_key=question",
                  "trainer.total_steps=3", "trainer.max_seq_len=64", "engines.server_args.num_blocks=3",
                  "engines.server_args.page_size=16"), timeout=600)
    m = metrics(run_dir)
    assert len(m) == 3 and all(r["skipped_prompts_at_load"] == 1 and r["skipped_prompts"] == 0 for r in m)
    with open(os.path.join(run_dir, "trained_prompts.jsonl")) as f:
        trained = [i for line in f for i in json.loads(line)["prompt_indices"]]
    assert 2 not in trained and set(trained) <= {0, 1, 3}


def test_reference_kl_penalty_is_applied(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "kl")
    run(small_run(tiny_models["llama"], run_dir, "loss.kl_coef=0.1", "trainer.total_steps=3", "async_rl.alpha=0"),
        timeout=600)
    rows = metrics(run_dir)
    # Step 0 starts from the reference weights: KL 0 up to float error; after updates it is positive.
    assert abs(rows[0]["train/kl_ref"]) < 1e-6
    assert rows[-1]["train/kl_ref"] > 1e-6
