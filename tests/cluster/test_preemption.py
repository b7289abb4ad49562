"""Preemption and time limits on the real cluster, with the multi-node template on three hosts.

1. `scancel --signal=USR1 --batch` (what `#SBATCH --signal=B:USR1@...` does near the time limit) →
   the batch shell sends one SIGTERM to each trainer rank on both trainer hosts → the controller
   checkpoints at the end of the step and exits 0 → REQUEUE=1: the job requeues itself (`scontrol
   requeue`), Slurm runs it again under the same id with checkpoint.resume=true, and it finishes.
   The ledger written before the requeue is kept line for line, and the whole ledger accounts for
   every prompt: each step once, none trained twice, the untrained ones only those outstanding at
   the end, as for an uninterrupted run.
2. Then the requeued run is killed hard mid-step (SIGKILL to every trainer process on both trainer
   hosts, as a crash would: no checkpoint; a `scancel` would not do, it sends SIGTERM first and the
   controller saves), the job fails and nothing of it survives on any host, and a resubmission
   resumes from the last periodic checkpoint and finishes with the same accounting.
"""

from __future__ import annotations

import os
import signal
import time

from tests.cluster.jobs import MULTI_ENV, FINISHED, Job, assert_accounted, assert_ledger_exact, host_pids, slurm

STEPS, SAVE_EVERY, PROMPTS_PER_STEP, ALPHA = 12, 2, 16, 2


def overrides(run_dir: str) -> list[str]:
    return [f"trainer.total_steps={STEPS}", "trainer.micro_batch_size=64", "data.shuffle=false",
            f"checkpoint.save_dir={run_dir}/ckpt", f"checkpoint.save_interval={SAVE_EVERY}",
            "checkpoint.save_hf_at_end=false"]


def wait_until(what: str, ok, *, timeout_s: float, job: Job) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            slurm("scancel", job.job_id, check=False)
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting until {what}\n{job.logs()}")
        time.sleep(0.5)


def test_usr1_requeue_resumes_exactly_then_a_hard_kill_resumes_from_the_last_checkpoint(cluster, warm_model):
    env = {**MULTI_ENV, "REQUEUE": "1"}
    job = Job("preempt", "multi_node_disaggregated.sbatch", env, [], sbatch_args=["--nodes=3"])
    job.overrides = overrides(job.run_dir)
    job.submit()
    job.wait_for_steps(3, timeout_s=150)

    # --- 1. USR1 to the batch shell, checkpoint, requeue, exact resume
    slurm("scancel", "--signal=USR1", "--batch", job.job_id)
    wait_until("the job requeued itself", lambda: "+ scontrol requeue" in open(job.batch_log).read(),
               timeout_s=90, job=job)
    before = job.ledger()  # the first run has ended; the requeued one truncates nothing after a USR1 save
    stopped_at = len(before)
    assert 3 <= stopped_at < STEPS, stopped_at
    wait_until("the requeued run trained a step", lambda: len(job.ledger()) > stopped_at, timeout_s=150, job=job)
    info = job.info()
    assert info["Restarts"] == "1" and info["JobState"] == "RUNNING", info
    assert job.ledger()[:stopped_at] == before, "the resumed run rewrote steps trained before the requeue"
    log = open(job.batch_log).read()
    assert "USR1" in log and "checkpoint.resume=true" in log

    # --- 2. a hard kill mid-step, then a resubmission
    target = min(stopped_at + SAVE_EVERY + 1, STEPS - 3)
    job.wait_for_steps(target, timeout_s=150)
    time.sleep(0.3)  # inside the next step
    killed_at = len(job.ledger())
    # Slurm's own cancel (`scancel`, even `scancel --signal=KILL`) sends SIGTERM first and SIGKILL only
    # after KillWait, and the controller saves on that SIGTERM: a graceful stop. A hard stop is what a
    # crashed host or the OOM killer does: SIGKILL to every trainer process (torchrun agents and ranks)
    # on both trainer hosts at once, mid-step; the job then fails by itself.
    victims = [pid for host in cluster[:2] for pid in host_pids(host, "launch/pretrain_async_rl.py")]
    assert len(victims) >= 4, victims  # an agent and a rank on each trainer host
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    state = job.wait(timeout_s=90)
    assert state in FINISHED - {"COMPLETED"}, state
    for host in cluster:  # no rank, agent or engine of the killed job is left on any host
        wait_until(f"nothing of job {job.job_id} runs on {host}",
                   lambda: not host_pids(host, "pretrain_async_rl") and not host_pids(host, "local_server"),
                   timeout_s=30, job=job)
    trainer_log = f"{job.run_dir}/slurm/trainer-mf-node1.log"
    assert open(trainer_log).read().count("SIGTERM: checkpointing") == 1, "the kill was not hard: a rank saw SIGTERM"
    # The last whole checkpoint (a save cut by the kill stays step_N.tmp and is never resumed from).
    last_ckpt = max(d for d in os.listdir(f"{job.run_dir}/ckpt") if d.startswith("step_") and d[5:].isdigit())
    assert int(last_ckpt[len("step_"):]) <= killed_at, (last_ckpt, killed_at)
    again = Job("preempt", "multi_node_disaggregated.sbatch", env, overrides(job.run_dir),
                sbatch_args=["--nodes=3"], run_dir=job.run_dir)
    again.submit()
    state = again.wait(timeout_s=240)
    assert state == "COMPLETED", f"resubmitted job {again.job_id}: {state}\n{again.logs()}"
    assert f"resumed from {job.run_dir}/ckpt/{last_ckpt}" in open(trainer_log).read(), again.logs()
    ledger = job.ledger()
    assert ledger[:stopped_at] == before
    assert_ledger_exact(ledger, steps=STEPS, prompts_per_step=PROMPTS_PER_STEP, alpha=ALPHA)
    assert_accounted(again.metrics()[-1:])
    print(f"USR1 at step {stopped_at}, requeued (Restarts=1); SIGKILL at step {killed_at}, resubmitted "
          f"job {again.job_id} resumed from {last_ckpt}; ledger: {len(ledger)} steps, "
          f"{sum(len(r['prompt_indices']) for r in ledger)} prompts, each once")
