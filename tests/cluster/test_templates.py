"""The three sbatch templates, unchanged, on a real three-host Slurm cluster (tools/cluster), with the
quickstart's warm tiny model on CPU. CPU hosts set only documented variables: ENGINE_BACKEND=local,
GPUS_PER_NODE (trainer ranks / engine slots per host), and `sbatch --gpus-per-node=0` overrides the
GPU directive.

    multi_node_disaggregated   mf-node1 + mf-node2: torchrun --nnodes=2, c10d rendezvous on mf-node1,
                               DP2 over gloo; mf-node3: one local engine server bound to mf-node3's
                               address with the API key; weights by broadcast across hosts
    single_node_split          one host: 1 trainer rank + 1 engine started by rank 0 (broadcast)
    single_node_colocated      one host: 1 trainer rank + 1 engine, time-shared (alpha 0)
"""

from __future__ import annotations

import json
import time

from tests.cluster.jobs import API_KEY, MULTI_ENV, Job, assert_accounted, assert_ledger_exact, in_host, step_table

# What the template does is asserted here: it starts, connects, pushes weights exactly and accounts for
# every sample. Whether the run learns across hosts is a question of steps and seeds, measured by
# benchmarks/cluster_learning.py (docs/cluster.md): 40 steps of this job there.
STEPS = 12


def curl(host: str, url: str, *headers: str) -> tuple[int, str]:
    args = ["curl", "-s", "-m", "5", "-o", "/dev/stdout", "-w", "\n%{http_code}"]
    for h in headers:
        args += ["-H", h]
    out = in_host(host, *args, url).stdout.rsplit("\n", 1)
    return (int(out[-1]) if out[-1].isdigit() else 0), out[0]


def test_multi_node_disaggregated_runs_across_three_hosts(cluster, warm_model) -> None:
    job = Job("multi", "multi_node_disaggregated.sbatch", MULTI_ENV,
              [f"trainer.total_steps={STEPS}", "trainer.micro_batch_size=64", "data.shuffle=false"],
              sbatch_args=["--nodes=3"])
    started = time.monotonic()
    job.submit()
    job.wait_for_steps(2, timeout_s=150)

    # The engine serves on mf-node3's own address, reached from a trainer host; the key is required
    # there, and only the key's holder sees the weights the trainer broadcast to it.
    engine = "http://mf-node3:30000"
    code, _ = curl("mf-node1", f"{engine}/get_weight_version")
    assert code == 401, f"GET /get_weight_version without the key from mf-node1 answered {code}"
    code, _ = curl("mf-node1", f"{engine}/generate")
    assert code == 401, f"POST /generate without the key from mf-node1 answered {code}"
    code, body = curl("mf-node1", f"{engine}/get_weight_version", f"Authorization: Bearer {API_KEY}")
    assert code == 200 and int(json.loads(body)["weight_version"]) >= 1, (code, body)
    code, _ = curl("mf-node3", "http://127.0.0.1:30000/health")
    assert code == 0, "the engine also answered on loopback: it must bind its host's address only"

    state = job.wait(timeout_s=240)
    elapsed = time.monotonic() - started
    assert state == "COMPLETED", f"job {job.job_id}: {state}\n{job.logs()}"
    info = job.info()
    assert info["NodeList"] == "mf-node[1-3]", info
    metrics, ledger = job.metrics(), job.ledger()
    assert len(metrics) == STEPS, job.logs()
    assert_accounted(metrics)
    assert_ledger_exact(ledger, steps=STEPS, prompts_per_step=16, alpha=2)
    assert max(r["staleness_max"] for r in metrics) <= 2, step_table(metrics)
    # Weights went mf-node1 -> mf-node3 by broadcast every step (the engine's version follows the trainer's),
    # and the engine scores as the trainer does.
    assert all(r["sync_gb"] > 0 for r in metrics)
    assert max(r["train_infer_logprob_diff"] for r in metrics) < 1e-4, step_table(metrics)
    # Every sampled token's mu is the labelled version's logprob: the engine generated with what it got.
    labelled = [r["mismatch_labelled_abs"] for r in metrics if r.get("mismatch_labelled_abs") is not None]
    assert labelled and max(labelled) < 1e-4, step_table(metrics)
    assert all(r["train/update_ok"] or r.get("train/zero_grad_skipped") for r in metrics), step_table(metrics)
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (metrics[:5], metrics[-5:]))
    log = open(job.batch_log).read()
    assert "trainer on mf-node1 mf-node2; engines on mf-node3" in log and "# trainer exit code 0" in log
    for host in ("mf-node1", "mf-node2"):  # one torchrun agent per trainer host, in one rendezvous
        trainer_log = open(f"{job.run_dir}/slurm/trainer-{host}.log").read()
        assert "Traceback" not in trainer_log, trainer_log[-3000:]
    print(f"multi_node_disaggregated: job {job.job_id} {elapsed:.0f} s, reward {first:.3f} -> {last:.3f} (reported)")


def test_single_node_templates_complete(cluster, warm_model) -> None:
    """Both single-node templates at once, one host each (they ask for --exclusive)."""
    steps = 12  # these two show that the templates run and account (learning: benchmarks/cluster_learning.py)
    split = Job("split", "single_node_split.sbatch", {"GPUS_PER_NODE": "2", "TRAIN_GPUS": "1"},
                [f"trainer.total_steps={steps}", "data.shuffle=false"])
    colocated = Job("colocated", "single_node_colocated.sbatch", {"GPUS_PER_NODE": "1"},
                    [f"trainer.total_steps={steps}", "data.shuffle=false"])
    started = time.monotonic()
    for job in (split, colocated):
        job.submit()
    for job, alpha in ((split, 2), (colocated, 0)):
        state = job.wait(timeout_s=300)
        assert state == "COMPLETED", f"{job.name} job {job.job_id}: {state}\n{job.logs()}"
        metrics = job.metrics()
        assert len(metrics) == steps, job.logs()
        assert_accounted(metrics)
        assert_ledger_exact(job.ledger(), steps=steps, prompts_per_step=16, alpha=alpha)
        assert max(r["staleness_max"] for r in metrics) <= alpha
        first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (metrics[:5], metrics[-5:]))
        # Reported, not asserted: a few steps at alpha 2 on one rank do not rise reliably (seen over
        # 20 steps: 0.048 -> 0.061 once, 0.061 -> 0.350 another time).
        print(f"{job.name}: job {job.job_id} on {job.info()['NodeList']}, reward {first:.3f} -> {last:.3f}")
    print(f"single-node templates: {time.monotonic() - started:.0f} s for both")


def test_a_path_under_tmp_is_refused_on_the_cluster(cluster, warm_model) -> None:
    """/tmp is each host's own here: the template refuses MODEL_PATH under it before starting anything,
    and the trainer its own keys (checkpoint.save_dir), each in one line naming the path (Slurm sets
    SLURM_CLUSTER_NAME=mfcluster in the job: the templates' trigger)."""
    model = Job("tmp_model", "single_node_split.sbatch", {"GPUS_PER_NODE": "2", "TRAIN_GPUS": "1",
                                                          "MODEL_PATH": "/tmp/mf-model"}, ["trainer.total_steps=2"])
    ckpt = Job("tmp_ckpt", "single_node_split.sbatch", {"GPUS_PER_NODE": "2", "TRAIN_GPUS": "1"},
               ["trainer.total_steps=2", "checkpoint.save_dir=/tmp/mf-ckpt", "checkpoint.save_interval=1"])
    for job in (model, ckpt):
        job.submit()
    assert model.wait(timeout_s=120) == "FAILED", model.logs()
    log = open(model.batch_log).read()
    assert "error: MODEL_PATH=/tmp/mf-model is under /tmp, which is each host's own on this cluster" in log, log
    assert ckpt.wait(timeout_s=240) == "FAILED", ckpt.logs()
    assert "config error: checkpoint.save_dir='/tmp/mf-ckpt' is under /tmp" in ckpt.text(), ckpt.logs()
