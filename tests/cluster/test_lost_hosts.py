"""Lost engine hosts on the real cluster: the multi-node template with the trainer on mf-node1 and one
attached local engine server on mf-node2 (under launch/slurm/engine_loop.sh), one run, two faults:

1. the engine server is SIGKILLed on its host: engine_loop.sh starts it again, the trainer's probes
   take it out of routing, and once it answers the next push re-syncs it and it is re-admitted;
2. the engine host's link is cut (its interface down in its namespace) for LINK_DOWN_S, then restored:
   requests to it fail and are counted, the run waits for it (every wait has a deadline:
   engines.down_timeout_s), and once the link is back the engine rejoins.

The run must finish every step with every sample accounted for (a lost host costs no sample), and
nothing may hang: the job is bounded by the test's deadline. A second, short job has its engine
host cut for good: the run stops by engines.down_timeout_s with one line naming the cause.
"""

from __future__ import annotations

import os
import re
import signal
import time

from tests.cluster.jobs import Job, assert_accounted, assert_ledger_exact, in_host, slurm

# Probes run every PROBE_S with a 5 s timeout each: PROBE_FAILURES misses in a row take ~14 s to see
# on a dead link, so the cut lasts longer than that (a shorter blip is absorbed: TCP retransmits, the
# stalled requests complete, nothing is counted).
STEPS, LINK_DOWN_S, PROBE_S, PROBE_FAILURES = 18, 20, 2, 2
ENV = {"TRAIN_NODES": "1", "GPUS_PER_NODE": "1", "ENGINE_TP": "1", "HEALTH_POLL_S": "1",
       "ENGINE_STARTUP_TIMEOUT": "120", "ENGINE_ARGS": "--num-threads 1", "RESTART_DELAY_S": "1"}


def engine_server_pids(host: str) -> list[int]:
    """The engine server's python process on host (not engine_loop.sh, whose command line names it too)."""
    import subprocess

    found = []
    for pid in subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[0].endswith(b"python") and argv[2] == b"megatron_flash.engines.local_server":
            found.append(int(pid))
    return found


def trainer_log(job: Job) -> str:
    return open(f"{job.run_dir}/slurm/trainer-mf-node1.log", errors="replace").read()


def readmissions(job: Job) -> int:
    """How often the rollout proxy routed to the engine again (after a re-sync at the fleet's version)."""
    return len(re.findall(r"rollout\.proxy\] engine http://mf-node2:30000 re-admitted", trainer_log(job)))


def wait_until(what: str, ok, *, timeout_s: float, job: Job) -> float:
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > timeout_s:
            slurm("scancel", job.job_id, check=False)
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting until {what}\n{job.logs()}")
        time.sleep(0.2)
    return time.monotonic() - start


def test_engine_host_killed_and_cut_off_costs_no_sample(cluster, warm_model) -> None:
    job = Job("lost", "multi_node_disaggregated.sbatch", ENV,
              [f"trainer.total_steps={STEPS}", "data.shuffle=false", f"engines.attach_probe_interval_s={PROBE_S}",
               f"engines.attach_probe_failures={PROBE_FAILURES}", "engines.down_timeout_s=120", "weight_sync.timeout_s=30"], sbatch_args=["--nodes=2"])
    job.submit()
    job.wait_for_steps(3, timeout_s=150)

    # --- 1. the engine server dies on its host
    (victim,) = engine_server_pids("mf-node2")
    os.kill(victim, signal.SIGKILL)
    engine_log = f"{job.run_dir}/slurm/engine-mf-node2-0.log"
    wait_until("engine_loop.sh started the server again",
               lambda: "server exited with code" in open(engine_log).read() and engine_server_pids("mf-node2"),
               timeout_s=30, job=job)
    readmit = wait_until("the trainer re-admitted the restarted engine", lambda: readmissions(job) == 1,
                         timeout_s=90, job=job)
    print(f"engine killed: restarted by engine_loop.sh and re-admitted {readmit:.1f} s after the kill")

    # --- 2. the engine host's link goes down, then comes back
    job.wait_for_steps(len(job.ledger()) + 2, timeout_s=60)  # serving again before the next fault
    at_cut = len(job.ledger())
    assert at_cut < STEPS - 2, f"the run was nearly over before the cut ({at_cut} steps)"
    assert in_host("mf-node2", "ip", "link", "set", "eth0", "down").returncode == 0
    try:
        time.sleep(LINK_DOWN_S)
    finally:
        assert in_host("mf-node2", "ip", "link", "set", "eth0", "up").returncode == 0
    back = wait_until("the engine rejoined after its link came back", lambda: readmissions(job) == 2,
                      timeout_s=90, job=job)
    print(f"link down {LINK_DOWN_S} s: engine re-admitted {back:.1f} s after the link came back "
          f"(probe period {PROBE_S} s)")

    state = job.wait(timeout_s=240)
    assert state == "COMPLETED", f"job {job.job_id}: {state}\n{job.logs()}"
    metrics, log = job.metrics(), trainer_log(job)
    assert len(metrics) == STEPS
    assert_accounted(metrics)
    assert_ledger_exact(job.ledger(), steps=STEPS, prompts_per_step=16, alpha=2)
    assert metrics[-1]["engine_restarts"] >= 2, metrics[-1]  # the kill and the cut, each noticed and healed
    assert log.count("out of service until it answers again") == 2, log[-3000:]  # each fault noticed once
    print(f"lost engine host: {STEPS} steps, {metrics[-1]['samples_trained']} samples trained, "
          f"engine_restarts {metrics[-1]['engine_restarts']:.0f}, engine_errors {metrics[-1]['engine_errors']}")


def test_engine_host_gone_for_good_stops_the_run_by_its_deadline(cluster, warm_model) -> None:
    down_timeout_s = 10
    job = Job("gone", "multi_node_disaggregated.sbatch", {**ENV, "ENGINE_MAX_RESTARTS": "0", "ENGINE_STOP_TIMEOUT": "5"},
              ["trainer.total_steps=200", "data.shuffle=false", f"engines.attach_probe_interval_s={PROBE_S}",
               f"engines.attach_probe_failures={PROBE_FAILURES}", f"engines.down_timeout_s={down_timeout_s}",
               # Requests stuck on the dead link end after this, not after the rollout drain's 30 s.
               "weight_sync.timeout_s=5", "engines.request_timeout_s=10"], sbatch_args=["--nodes=2"])
    job.submit()
    job.wait_for_steps(1, timeout_s=150)
    assert in_host("mf-node2", "ip", "link", "set", "eth0", "down").returncode == 0
    try:
        # The batch shell reports the trainer's exit while the engine host is still unreachable.
        stopped = wait_until("the trainer stopped and the batch shell reported it",
                             lambda: "# trainer exit code" in open(job.batch_log).read(), timeout_s=180, job=job)
    finally:
        in_host("mf-node2", "ip", "link", "set", "eth0", "up")
    state = job.wait(timeout_s=90)
    assert state == "FAILED", f"job {job.job_id}: {state}\n{job.logs()}"
    assert "# trainer exit code 1" in open(job.batch_log).read()
    cause = [line for line in trainer_log(job).splitlines()
             if re.search(r"(WeightSyncError|RolloutError): .*mf-node2:30000|no rollout request succeeded", line)]
    assert cause, job.logs()
    print(f"engine host cut for good: the batch shell reported the trainer's exit {stopped:.0f} s after the cut "
          f"(engines.down_timeout_s={down_timeout_s}); the line: {cause[0].strip()[:240]}")
