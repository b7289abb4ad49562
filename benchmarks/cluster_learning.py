"""Learning across hosts: the multi-node template on the Slurm mini-cluster (tools/cluster), the same job
as the cluster tier's (tests/cluster/test_templates.py), longer, several times. The tier asserts what
the template does (steps, ledger, weights, accounting, the key); whether the quickstart task learns when
its trainer spans two hosts and its engine a third is measured here (docs/cluster.md).

    sudo .venv/bin/python benchmarks/cluster_learning.py --runs 3 --steps 40
    sudo .venv/bin/python benchmarks/cluster_learning.py --runs 3 --steps 40 --hogs 2   # two CPU hogs beside it

mf-node1 + mf-node2: torchrun --nnodes=2 (DP2, gloo); mf-node3: one local engine server; alpha 2, tis,
the quickstart's seed-0 warm model (benchlib's cached one). One JSON line per run: reward of the first
and the last 5 steps, the gain, seconds of the job, mean staleness, the largest labelled-version gap and
probe. The cluster is brought up (3 hosts) and always taken down at the end. Root only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import REPO, log, quickstart_warm_model, uptime_load  # noqa: E402

from tests.cluster.jobs import CLUSTER, MULTI_ENV, WARM_MODEL, Job, assert_accounted, assert_ledger_exact  # noqa: E402

NAME = "cluster_learning"


def cluster(command: str) -> None:
    args = [command, "3"] if command == "up" else [command]
    proc = subprocess.run([sys.executable, CLUSTER, *args], capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise SystemExit(f"{NAME}: cluster {command} failed: {proc.stderr.strip()}{proc.stdout.strip()}")


def one_run(index: int, steps: int) -> dict:
    job = Job(f"learn{index}", "multi_node_disaggregated.sbatch", MULTI_ENV,
              [f"trainer.total_steps={steps}", "trainer.micro_batch_size=64", "data.shuffle=false"],
              sbatch_args=["--nodes=3"])
    started = time.monotonic()
    job.submit()
    state = job.wait(timeout_s=240 + 6 * steps)
    seconds = time.monotonic() - started
    metrics = job.metrics()
    if state != "COMPLETED" or len(metrics) != steps:
        return {"run": index, "state": state, "steps": len(metrics), "logs": job.logs()[-2000:]}
    assert_accounted(metrics)
    assert_ledger_exact(job.ledger(), steps=steps, prompts_per_step=16, alpha=2)
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (metrics[:5], metrics[-5:]))
    labelled = [r["mismatch_labelled_abs"] for r in metrics if r.get("mismatch_labelled_abs") is not None]
    return {"run": index, "state": state, "steps": steps, "reward_first5": round(first, 3),
            "reward_last5": round(last, 3), "gain": round(last - first, 3), "job_s": round(seconds, 1),
            "staleness_mean": round(statistics.fmean(r["staleness_mean"] for r in metrics), 2),
            "mismatch_labelled_max": max(labelled) if labelled else None,
            "probe_max": max(r["train_infer_logprob_diff"] for r in metrics)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside the cluster (a loaded box)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit(f"{NAME}: needs root (tools/cluster)")
    subprocess.run(["bash", os.path.join(REPO, "tools", "cluster", "install.sh")], check=True, capture_output=True)
    if quickstart_warm_model(seed=0, name=NAME) != WARM_MODEL:
        raise SystemExit(f"{NAME}: the warm model is not where the cluster jobs look ({WARM_MODEL})")
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.hogs)]
    results = []
    try:
        cluster("up")
        for i in range(args.runs):
            results.append(one_run(i, args.steps))
            log(NAME, json.dumps(results[-1]))
            print(json.dumps({**results[-1], "hogs": args.hogs, "load": uptime_load()}), flush=True)
    finally:
        for h in hogs:
            h.kill()
        cluster("down")
    gains = [r["gain"] for r in results if "gain" in r]
    print(json.dumps({"summary": True, "runs": len(results), "completed": len(gains), "hogs": args.hogs,
                      "steps": args.steps, "gain_mean": round(statistics.fmean(gains), 3) if gains else None,
                      "gain_min": min(gains) if gains else None}), flush=True)
    return 0 if len(gains) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
