"""Submitting the templates to the mini-cluster (tools/cluster) with Slurm's own commands, and reading
what the jobs left: job state from `scontrol`, metrics and the trained-prompt ledger from the run
folder. Every wait has a deadline and its failure message carries the job's logs.

Run folders live under the checkout (.cache/cluster-runs/): the hosts share this machine's filesystem
except /tmp, which is each host's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field

from tests.conftest import REPO

CLUSTER = os.path.join(REPO, "tools", "cluster", "cluster.py")
STATE = os.environ.get("MF_CLUSTER_DIR", "/var/lib/mf-cluster")
SLURM_CONF = os.path.join(STATE, "etc", "slurm.conf")
# benchlib's cached quickstart sort4 warm model, seed 0 (what tools/cluster/warm_model.py builds, bit for bit;
# the soak of `make test` uses the same one, so CI warms it up once): tests/cluster/conftest.py `warm_model`.
WARM_MODEL = os.path.join(REPO, "runs", "bench_models", "sort4_quickstart_s0", "warm_model")
RUNS = os.path.join(REPO, ".cache", "cluster-runs")
API_KEY = "cluster-test-key-7f3a"  # the engines' key for these jobs (a real job generates one)
# The multi-node template on the three CPU hosts: 2 trainer hosts of one rank each, one engine host.
MULTI_ENV = {"TRAIN_NODES": "2", "GPUS_PER_NODE": "1", "ENGINE_TP": "1", "HEALTH_POLL_S": "1",
             "ENGINE_STARTUP_TIMEOUT": "120", "ENGINE_ARGS": "--num-threads 1"}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def slurm(*args: str, timeout: float = 30, check: bool = True) -> str:
    """A Slurm client command against the mini-cluster; its stdout."""
    proc = subprocess.run(args, env={**os.environ, "SLURM_CONF": SLURM_CONF}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return f"(no {path})\n"


@dataclass
class Job:
    """One sbatch submission of a template: its folder, its id, and what it wrote."""

    name: str
    template: str
    env: dict[str, str]
    overrides: list[str]
    sbatch_args: list[str] = field(default_factory=list)
    run_dir: str = ""
    job_id: str = ""

    def __post_init__(self) -> None:
        if not self.run_dir:  # a resubmission passes the first job's folder
            self.run_dir = os.path.join(RUNS, f"{self.name}-{int(time.time() * 1000) % 10**9}")
            os.makedirs(self.run_dir)

    @property
    def rl_dir(self) -> str:
        return os.path.join(self.run_dir, "rl")

    @property
    def batch_log(self) -> str:
        return os.path.join(self.run_dir, "batch.out")

    def submit(self) -> str:
        """`sbatch` the template, unchanged, from the repository root; the job id."""
        env = {**os.environ, "SLURM_CONF": SLURM_CONF, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "VENV": os.path.join(REPO, ".venv"), "MODEL_PATH": WARM_MODEL,
               "CONFIG": "configs/quickstart_cpu.yaml", "ENGINE_BACKEND": "local",
               "SGLANG_API_KEY": API_KEY, "LOG_DIR": os.path.join(self.run_dir, "slurm"), **self.env}
        cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--open-mode=append", f"--output={self.batch_log}",
               *self.sbatch_args, os.path.join("launch", "slurm", self.template),
               f"logging.dir={self.rl_dir}", "logging.wandb_mode=disabled", "logging.tensorboard=false",
               *self.overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        self.job_id = proc.stdout.strip().split(";")[0]
        return self.job_id

    def info(self) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RunTime, Restarts, NodeList, ...)."""
        out = slurm("scontrol", "show", "job", "-o", self.job_id, check=False)
        fields = {}
        for word in out.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def state(self) -> str:
        return self.info().get("JobState", "UNKNOWN")

    def logs(self) -> str:
        parts = [f"--- {self.batch_log}\n{tail(self.batch_log, 40)}"]
        slurm_dir = os.path.join(self.run_dir, "slurm")
        for name in sorted(os.listdir(slurm_dir)) if os.path.isdir(slurm_dir) else []:
            parts.append(f"--- {name}\n{tail(os.path.join(slurm_dir, name))}")
        return "\n".join(parts)

    def text(self) -> str:
        """The batch log and every per-host log whole: a refusal printed before torchrun's long
        traceback falls outside logs()' tails."""
        slurm_dir = os.path.join(self.run_dir, "slurm")
        names = sorted(os.listdir(slurm_dir)) if os.path.isdir(slurm_dir) else []
        return "\n".join(tail(path, 10**6) for path in [self.batch_log] + [os.path.join(slurm_dir, n) for n in names])

    def wait(self, *, timeout_s: float, states: set[str] = FINISHED) -> str:
        """Poll until the job's state is in `states`; the state. Cancels the job on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state in states:
                return state
            if time.monotonic() > deadline:
                slurm("scancel", self.job_id, check=False)
                raise AssertionError(f"job {self.job_id} ({self.name}) still {state} after {timeout_s:.0f} s; "
                                     f"cancelled\n{self.logs()}")
            time.sleep(1)

    def wait_for_steps(self, n: int, *, timeout_s: float) -> None:
        """Until the run's ledger holds at least n steps (the job must keep running)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ledger()) < n:
            state = self.state()
            if state in FINISHED or time.monotonic() > deadline:
                slurm("scancel", self.job_id, check=False)
                raise AssertionError(f"job {self.job_id} ({self.name}): {len(self.ledger())} of {n} steps, state "
                                     f"{state}\n{self.logs()}")
            time.sleep(0.5)

    def metrics(self) -> list[dict]:
        return rows(os.path.join(self.rl_dir, "metrics.jsonl"))

    def ledger(self) -> list[dict]:
        return rows(os.path.join(self.rl_dir, "trained_prompts.jsonl"))


def assert_accounted(metrics: list[dict]) -> None:
    """Every row's identity: admitted = trained + outstanding + every drop and skip counter."""
    drops = ("dropped_stale", "regenerated_stale", "dropped_filtered", "reward_failed", "dropped_error",
             "samples_skipped", "samples_cancelled")
    for r in metrics:
        rest = r["samples_trained"] + r["samples_outstanding"] + sum(r[k] for k in drops)
        assert r["samples_admitted"] == rest, f"step {r['step']}: admitted {r['samples_admitted']} != {rest}: {r}"


def assert_ledger_exact(ledger: list[dict], *, steps: int, prompts_per_step: int, alpha: int) -> None:
    """Each step exactly once, no prompt trained twice, and the prompts never trained only those still
    outstanding when the run ended (data.shuffle=false: index = order drawn)."""
    assert [r["step"] for r in ledger] == list(range(steps)), [r["step"] for r in ledger]
    trained = [i for r in ledger for i in r["prompt_indices"]]
    assert len(trained) == len(set(trained)) == steps * prompts_per_step, "a prompt was trained twice"
    never = set(range(max(trained) + 1)) - set(trained)
    assert len(never) <= (alpha + 1) * prompts_per_step, sorted(never)


def step_table(metrics: list[dict]) -> str:
    """The per-step numbers that tell a run that did not learn apart: no update (update_ok, grad_norm),
    stale samples (staleness), an engine off the labelled weights (mismatch_labelled_abs), or a noisy
    start (reward). For failure messages."""
    keys = ("step", "reward_mean", "train/grad_norm", "train/update_ok", "staleness_mean", "train/mismatch_abs",
            "mismatch_labelled_abs", "train_infer_logprob_diff", "response_len_mean")
    lines = [" ".join(keys)]
    for r in metrics:
        lines.append(" ".join(f"{r[k]:.3g}" if isinstance(r.get(k), (int, float)) else str(r.get(k)) for k in keys))
    return "\n".join(lines)


def in_host(host: str, *cmd: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`cmd` in host's network namespace (curl from another host, ip link on its interface)."""
    return subprocess.run(["nsenter", f"--net=/run/netns/{host}", *cmd], capture_output=True, text=True,
                          timeout=timeout)


def host_pids(host: str, pattern: str) -> list[int]:
    """Pids of the processes in host's namespace whose command line contains `pattern`."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    found = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if pattern in f.read().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(pid))
        except OSError:
            pass
    return found
