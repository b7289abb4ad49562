"""An elastic rollout fleet on the real cluster: one training job (trainer on mf-node1, its own engine on
mf-node2, registration open: the multi-node template's FLEET_PORT) and worker jobs of
launch/slurm/rollout_workers.sbatch, one run:

(d) a worker job whose key is wrong (its engine on mf-node5) is refused with 401 and ends FAILED; the
    run never hears of its engine, never pushes to it;
(a) a worker job adds two engine hosts (mf-node3, mf-node4; the key read from the training job's
    fleet.key): both join (a full push, the probe, then routed to) and serve, and samples per second
    rise (every engine latency-bound: the local engine's --decode-step-ms, as a GPU's decode step);
(c) mf-node4's link is cut: the run loses it after its failed probes, takes it out and goes on; once the
    link is back its worker registers it again and it rejoins;
(b) the worker job is cancelled mid-generation (`scancel`: SIGTERM, then SIGKILL): both workers
    deregister their engines, whose in-flight requests the run re-issues.

Then the training job is stopped the way a time limit does (USR1 → checkpoint → exit 0): every step is
trained once, no prompt twice, every sample accounted for, staleness within α.
"""

from __future__ import annotations

import os
import re
import statistics

from tests.cluster.jobs import Job, assert_accounted, assert_ledger_exact, in_host, slurm, step_table
from tests.cluster.test_lost_hosts import wait_until

DECODE_MS, PROBE_S, PROBE_FAILURES, ALPHA = 40, 1, 2, 2
ENGINE_ENV = {"GPUS_PER_NODE": "1", "ENGINE_TP": "1", "ENGINE_ARGS": f"--num-threads 1 --decode-step-ms {DECODE_MS}",
              "RESTART_DELAY_S": "1"}


def trainer_log(job: Job) -> str:
    return open(f"{job.run_dir}/slurm/trainer-mf-node1.log", errors="replace").read()


def rate(rows: list[dict]) -> float:
    return statistics.median(r["samples_per_s"] for r in rows)


def test_workers_join_leave_and_are_lost_without_losing_a_sample(cluster, warm_model) -> None:
    job = Job("fleet", "multi_node_disaggregated.sbatch",
              {**ENGINE_ENV, "TRAIN_NODES": "1", "HEALTH_POLL_S": "1", "ENGINE_STARTUP_TIMEOUT": "120"},
              ["trainer.total_steps=400", "data.shuffle=false", f"async_rl.alpha={ALPHA}",
               "engines.max_inflight_per_engine=16", f"engines.attach_probe_interval_s={PROBE_S}",
               f"engines.attach_probe_failures={PROBE_FAILURES}", "engines.down_timeout_s=120",
               "weight_sync.timeout_s=15", "engines.request_timeout_s=30"], sbatch_args=["--nodes=2"])
    job.submit()
    address = os.path.join(job.run_dir, "slurm", "fleet.json")
    workers: list[Job] = []
    try:
        job.wait_for_steps(2, timeout_s=150)
        assert os.path.exists(address) and oct(os.stat(os.path.join(job.run_dir, "slurm", "fleet.key")).st_mode)[-3:] == "600"

        # --- (d) a worker with the wrong key (mf-node5) and (a) two engine hosts that join (mf-node3, mf-node4;
        # the key read from the training job's fleet.key), submitted together
        intruder = Job("intruder", "rollout_workers.sbatch", {**ENGINE_ENV, "FLEET_ADDRESS": address,
                                                               "SGLANG_API_KEY": "not-the-runs-key"}, [],
                       sbatch_args=["--nodes=1", "--nodelist=mf-node5"])
        worker = Job("workers", "rollout_workers.sbatch", {**ENGINE_ENV, "FLEET_ADDRESS": address, "SGLANG_API_KEY": ""},
                     [], sbatch_args=["--nodes=2", "--nodelist=mf-node3,mf-node4"])
        workers += [intruder, worker]
        intruder.submit()
        worker.submit()
        wait_until("both worker engines joined", lambda: any(r.get("engines_joined", 0) >= 2 for r in job.metrics()),
                   timeout_s=120, job=job)
        baseline = [r for r in job.metrics()[1:] if r.get("fleet_size") == 1]  # the first step waits for a batch
        assert intruder.wait(timeout_s=120) == "FAILED", intruder.logs()
        worker_log = open(os.path.join(intruder.run_dir, "slurm", "worker-mf-node5.log")).read()
        assert "401" in worker_log and "refused this worker's key" in worker_log, worker_log
        log = trainer_log(job)
        assert "mf-node5" not in log  # never registered, never pushed to
        stamps = [(m.group(1), m.group(2)[7:], m.group(3)) for m in re.finditer(
            r"\[(\d\d:\d\d:\d\d) megatron_flash\.rollout\.(?:fleet|proxy_fleet)\] engine (http://mf-node\d:30000) "
            r"(registered|joined the fleet)", log)]
        joined_at = len(job.metrics())
        job.wait_for_steps(joined_at + 8, timeout_s=120)
        grown = job.metrics()[joined_at:joined_at + 8]
        assert all(r["fleet_size"] == 3 for r in grown), step_table(grown)
        served = {i: sum(r.get(f"engine{i}_requests", 0) for r in grown) for i in (1, 2)}
        assert all(n > 0 for n in served.values()), served
        before, after = rate(baseline), rate(grown)
        assert after > before, (before, after, step_table(baseline + grown))

        # --- (c) mf-node4's link is cut: lost after its failed probes, the run goes on
        assert in_host("mf-node4", "ip", "link", "set", "eth0", "down").returncode == 0
        try:
            lost = wait_until("the run lost mf-node4", lambda: "mf-node4:30000 out of the fleet (lost" in trainer_log(job),
                              timeout_s=60, job=job)
            job.wait_for_steps(len(job.metrics()) + 2, timeout_s=60)  # it goes on without it
        finally:
            assert in_host("mf-node4", "ip", "link", "set", "eth0", "up").returncode == 0
        rejoined = wait_until("mf-node4's worker registered it again and it rejoined",
                              lambda: any(r.get("engines_joined", 0) >= 3 for r in job.metrics()), timeout_s=90, job=job)

        # --- (b) the worker job is cancelled mid-generation
        job.wait_for_steps(len(job.metrics()) + 2, timeout_s=60)
        slurm("scancel", worker.job_id)
        assert worker.wait(timeout_s=90) in ("CANCELLED", "COMPLETED"), worker.logs()
        wait_until("both engines left", lambda: trainer_log(job).count("left the fleet (left:") >= 2, timeout_s=60,
                   job=job)
        after_leave = len(job.metrics())
        job.wait_for_steps(after_leave + 3, timeout_s=120)  # on its own engine again
        slurm("scancel", "--signal=USR1", "--batch", job.job_id)  # as a time limit would: save and end
        state = job.wait(timeout_s=180)
    finally:
        for w in workers:
            slurm("scancel", w.job_id, check=False) if w.job_id else None
        in_host("mf-node4", "ip", "link", "set", "eth0", "up")
    assert state == "COMPLETED", f"job {job.job_id}: {state}\n{job.logs()}"
    metrics, ledger = job.metrics(), job.ledger()
    assert_accounted(metrics)
    assert_ledger_exact(ledger, steps=len(ledger), prompts_per_step=16, alpha=ALPHA)
    assert max(r["staleness_max"] for r in metrics) <= ALPHA
    last = metrics[-1]
    assert last["engines_joined"] == 3 and last["engines_left"] == 3 and last["fleet_size"] == 1, last
    text = trainer_log(job)
    reissued = [int(n) for n in re.findall(r"left the fleet \(left: [^)]*\); (\d+) request", text)]
    print(f"fleet: baseline {before:.1f} samples/s on 1 engine, {after:.1f} on 3 ({after / before:.2f}x); "
          f"join timeline {stamps}; mf-node4 lost {lost:.1f} s after the cut (probe {PROBE_S} s x {PROBE_FAILURES}), "
          f"rejoined {rejoined:.1f} s after the link came back; cancelled worker re-issued {reissued}; "
          f"{len(ledger)} steps, requests_reissued {last['requests_reissued']:.0f}")
