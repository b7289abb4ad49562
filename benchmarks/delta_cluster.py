"""Delta against whole weight pushes across a throttled link: the multi-node template on the Slurm
mini-cluster (tools/cluster), SmolLM2-135M served in bf16 by the engine host, the trainer (fp32) on
another host pushing by broadcast (gloo), the engine host's link throttled with tc (tbf).

    sudo .venv/bin/python benchmarks/delta_cluster.py --rates 1gbit,100mbit --steps 6
    sudo .venv/bin/python benchmarks/delta_cluster.py --rates 100mbit --modes on --steps 4   # one job
    sudo .venv/bin/python benchmarks/delta_cluster.py --rates 100mbit,1gbit --steps 5 weight_sync.probe=false engines.dtype=bfloat16

mf-node1: torchrun, one rank (trainer, fp32, slurmctld too); mf-node2: one local engine server
(--dtype bfloat16, --num-threads 1). For each rate, the engine host's link is shaped in both directions
(tbf on the bridge-side veth mfv2: trainer → engine, the push; and on mf-node2's eth0: engine →
trainer), the rate is measured with a TCP transfer mf-node1 → mf-node2, then one job per mode:
weight_sync.delta=off (every push whole) and weight_sync.delta=on with delta_anchor_every=0 (only
the first push whole). RL as usual otherwise: optimizer.lr 1e-6, TIS, alpha 2, arithmetic questions
with SmolLM2's chat template, short replies and small batches so that the push weighs.

One JSON line per job: the first push apart (seconds, bytes), then over pushes 2..N the median and
range of sync/seconds and time_sync, medians of sync/bytes, sync/bytes_full, sync/delta_density, the
median time_step (steps 2..N), checksum failures, the probe's largest train/inference logprob gap,
the box's 1-minute load when the job started. A summary line at the end. tc and the cluster are always
taken down at the end, error or not. Root only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import REPO, log, uptime_load  # noqa: E402

from tests.cluster.jobs import CLUSTER, Job  # noqa: E402

NAME = "delta_cluster"
MODEL = "/work/smollm2"
HOSTS = 2  # mf-node1 trainer, mf-node2 engine
TRAINER_HOST, ENGINE_HOST = "mf-node1", "mf-node2"
ENGINE_ADDR = "10.213.0.2"
BRIDGE_VETH = "mfv2"  # root-side end of mf-node2's link (tools/cluster/cluster.py net_up)
ENV = {"TRAIN_NODES": "1", "GPUS_PER_NODE": "1", "ENGINE_TP": "1", "HEALTH_POLL_S": "1",
       "ENGINE_STARTUP_TIMEOUT": "300", "ENGINE_ARGS": "--num-threads 1 --dtype bfloat16",
       "MODEL_PATH": MODEL, "CONFIG": "configs/quickstart_cpu.yaml"}
# SmolLM2 on the quickstart config's skeleton (no eval): configs/smollm2_arith_cpu.yaml's task, smaller.
RL = ["optimizer.lr=1e-6", "loss.name=tis", "async_rl.alpha=2", "data.task=arith", "data.task_args.digits=1",
      "data.task_args.operations=+", "data.apply_chat_template=true", "data.num_samples=2048", "rollout.reward=math",
      "trainer.max_seq_len=112", "trainer.version_check_interval=0", "engines.server_args.context_length=160", "data.shuffle=false",
      # The post-push probe scores random token ids: SmolLM2 in bf16 (engine) against fp32 (trainer) gives a mean
      # |Δ logprob| of ~0.11 there (HF's bf16 model: 0.06), over the default 0.05, which stops the run at the
      # first push. Wrong weights give O(1).
      "weight_sync.probe_threshold=0.3"]


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()}{proc.stdout.strip()}")
    return proc


def cluster(command: str) -> None:
    args = [command, str(HOSTS)] if command == "up" else [command]
    proc = subprocess.run([sys.executable, CLUSTER, *args], capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise SystemExit(f"{NAME}: cluster {command} failed: {proc.stderr.strip()}{proc.stdout.strip()}")


def ns(host: str, *cmd: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{host}", *cmd]


# ------------------------------------------------------------------------------------------ tc
def tc_set(rate: str) -> None:
    tc_clear()
    tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    sh("tc", "qdisc", "add", "dev", BRIDGE_VETH, *tbf)  # bridge → mf-node2: the push
    sh(*ns(ENGINE_HOST, "tc", "qdisc", "add", "dev", "eth0", *tbf))  # mf-node2 → bridge


def tc_clear() -> None:
    sh("tc", "qdisc", "del", "dev", BRIDGE_VETH, "root", check=False)
    if os.path.exists(f"/run/netns/{ENGINE_HOST}"):
        sh(*ns(ENGINE_HOST, "tc", "qdisc", "del", "dev", "eth0", "root"), check=False)


def tc_show() -> str:
    a = sh("tc", "qdisc", "show", "dev", BRIDGE_VETH, check=False).stdout.strip()
    b = sh(*ns(ENGINE_HOST, "tc", "qdisc", "show", "dev", "eth0"), check=False).stdout.strip()
    return f"{BRIDGE_VETH}: {a} | {ENGINE_HOST} eth0: {b}"


RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""
SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): s.sendall(buf)
s.close()
"""


def measure_rate(mib: int, port: int = 5599) -> dict:
    """TCP mf-node1 → mf-node2, `mib` MiB; Mbit/s at the receiver (first byte to last)."""
    recv = subprocess.Popen(ns(ENGINE_HOST, sys.executable, "-c", RECV, ENGINE_ADDR, str(port)),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
        sh(*ns(TRAINER_HOST, sys.executable, "-c", SEND, ENGINE_ADDR, str(port), str(mib)), timeout=300)
        nbytes, seconds = recv.stdout.readline().split()
        recv.wait(timeout=30)
    finally:
        if recv.poll() is None:
            recv.kill()
    return {"mib": mib, "seconds": round(float(seconds), 2), "mbit_s": round(int(nbytes) * 8 / float(seconds) / 1e6, 1)}


# ------------------------------------------------------------------------------------------ jobs
def med_range(xs: list[float], nd: int = 3) -> dict:
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd)}


def median(xs: list[float], nd: int = 4):
    return round(statistics.median(xs), nd) if xs else None


def summarise(metrics: list[dict]) -> dict:
    pushes = [r for r in metrics if r.get("sync/seconds") is not None]
    first, rest = (pushes[0] if pushes else {}), pushes[1:]
    col = lambda rows, k: [float(r[k]) for r in rows if r.get(k) is not None]  # noqa: E731
    steps = metrics[1:]  # step 0 waits for the first rollout
    probes = col(metrics, "train_infer_logprob_diff")
    return {
        "pushes": len(pushes),
        "first_push": {"step": first.get("step"), "sync_s": first.get("sync/seconds"), "time_sync": first.get("time_sync"),
                       "bytes": first.get("sync/bytes"), "bytes_full": first.get("sync/bytes_full"),
                       "anchor": first.get("sync/anchor"), "density": first.get("sync/delta_density")},
        "sync_s_2N": med_range(col(rest, "sync/seconds")),
        "time_sync_2N": med_range(col(rest, "time_sync")),
        # The push without its probe: the probe's /generate queues behind the rollout requests the engine runs.
        "sync_minus_probe_s_2N": med_range([float(r["sync/seconds"]) - float(r.get("time_probe") or 0.0) for r in rest]),
        "first_push_minus_probe_s": (round(float(first["sync/seconds"]) - float(first.get("time_probe") or 0.0), 3)
                                     if first else None),
        "per_push": {"sync_s": [round(float(r["sync/seconds"]), 2) for r in pushes],
                     "probe_s": [round(float(r.get("time_probe") or 0.0), 2) for r in pushes],
                     "bytes": [int(r["sync/bytes"]) for r in pushes],
                     "step_s": [round(float(r["time_step"]), 1) for r in metrics if r.get("time_step") is not None]},
        "encode_s_2N_median": median(col(rest, "sync/encode_seconds")),
        "time_probe_2N_median": median(col(rest, "time_probe")),
        "bytes_2N_median": median(col(rest, "sync/bytes"), 0),
        "bytes_full_2N_median": median(col(rest, "sync/bytes_full"), 0),
        "density_2N_median": median(col(rest, "sync/delta_density"), 6),
        "anchors_2N": sum(col(rest, "sync/anchor")),
        "time_step_2N": med_range(col(steps, "time_step"), 2),
        "time_train_2N_median": median(col(steps, "time_train"), 2),
        "time_rollout_wait_2N_median": median(col(steps, "time_rollout_wait"), 2),
        "checksum_failures": sum(col(metrics, "sync/checksum_failures")),
        "delta_refused": sum(col(metrics, "sync/delta_refused")),
        "logprob_diff_max": max(probes) if probes else None,
        "reward_mean": round(statistics.fmean(col(metrics, "reward_mean")), 3) if col(metrics, "reward_mean") else None,
    }


def one_job(rate: str, mode: str, args: argparse.Namespace) -> dict:
    overrides = [*RL, f"trainer.total_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
                 f"trainer.micro_batch_size={args.batch}", f"rollout.n_samples_per_prompt={args.group}",
                 f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"engines.server_args.max_running_requests={args.max_running}",
                 # quoted: OmegaConf reads a bare on/off as a YAML 1.1 boolean (refused: "got 'True'")
                 f"weight_sync.delta='{mode}'", *args.overrides]
    if mode == "on":
        overrides.append("weight_sync.delta_anchor_every=0")
    job = Job(f"delta-{rate}-{mode}", "multi_node_disaggregated.sbatch", ENV, overrides, sbatch_args=[f"--nodes={HOSTS}"])
    load = uptime_load()
    started = time.monotonic()
    job.submit()
    log(NAME, f"{rate} delta={mode}: job {job.job_id}, {job.run_dir}, load {load}")
    try:
        state = job.wait(timeout_s=args.job_timeout)
    except AssertionError as exc:
        state = f"TIMEOUT ({str(exc).splitlines()[0]})"
    seconds = time.monotonic() - started
    metrics = job.metrics()
    out = {"rate": rate, "delta": mode, "state": state, "steps": len(metrics), "job_s": round(seconds, 1),
           "load_at_start": load, "run_dir": job.run_dir, **(summarise(metrics) if metrics else {})}
    out["completed"] = state == "COMPLETED" and len(metrics) == args.steps
    if not out["completed"]:
        out["logs"] = job.logs()[-3000:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit,100mbit", help="tc tbf rates, comma-separated (none = no qdisc)")
    ap.add_argument("--modes", default="off,on", help="weight_sync.delta values, comma-separated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16, help="trainer.global_batch_size = micro_batch_size")
    ap.add_argument("--group", type=int, default=8, help="rollout.n_samples_per_prompt")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=16,
                    help="engine --max-running-requests; at the batch size (16) the post-push probe waits for a "
                         "free slot, i.e. for the batch being generated, and sync/seconds carries that wait")
    ap.add_argument("--rate-mib", type=int, default=0, help="MiB for the rate check (0: 12 s worth at the rate)")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="more config overrides for every job, e.g. weight_sync.probe=false engines.dtype=bfloat16")
    ap.add_argument("--summarise", nargs="*", metavar="RUN_DIR",
                    help="only print the summary of jobs already run (their .cache/cluster-runs/<job> folders)")
    args = ap.parse_args()
    if args.summarise:
        for run_dir in args.summarise:
            with open(os.path.join(run_dir, "rl", "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f if line.strip()]
            print(json.dumps({"run_dir": run_dir, "steps": len(metrics), **summarise(metrics)}), flush=True)
        return 0
    if os.geteuid() != 0:
        raise SystemExit(f"{NAME}: needs root (tools/cluster, tc)")
    subprocess.run(["bash", os.path.join(REPO, "tools", "cluster", "install.sh")], check=True, capture_output=True)

    def stop(signum, _frame):  # a background start ignores SIGINT: make INT and TERM unwind (tc + cluster down)
        raise SystemExit(f"{NAME}: signal {signum}")
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(json.dumps({"start": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "uptime": sh("uptime").stdout.strip(),
                      "cpus": os.cpu_count()}), flush=True)
    results, rates = [], {}
    try:
        cluster("up")
        for rate in args.rates.split(","):
            if rate == "none":
                tc_clear()
            else:
                tc_set(rate)
            mbit = 1000.0 if rate == "none" else float(rate.lower().replace("mbit", "e0").replace("gbit", "e3"))
            mib = args.rate_mib or max(8, int(mbit * 12 / 8 / 1.048576))
            rates[rate] = {**measure_rate(mib), "tc": tc_show()}
            print(json.dumps({"rate": rate, "measured": rates[rate]}), flush=True)
            for mode in args.modes.split(","):
                results.append(one_job(rate, mode, args))
                log(NAME, json.dumps({k: v for k, v in results[-1].items() if k != "logs"}))
                print(json.dumps(results[-1]), flush=True)
    finally:
        try:
            tc_clear()
        finally:
            cluster("down")
    summary = {"summary": True, "end": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jobs": len(results),
               "completed": sum(r["completed"] for r in results), "rates_measured_mbit_s":
               {k: v["mbit_s"] for k, v in rates.items()},
               "sync_s_2N_median": {f"{r['rate']}/{r['delta']}": (r.get("sync_s_2N") or {}).get("median") for r in results},
               "first_push_s": {f"{r['rate']}/{r['delta']}": (r.get("first_push") or {}).get("sync_s") for r in results},
               "time_step_2N_median": {f"{r['rate']}/{r['delta']}": (r.get("time_step_2N") or {}).get("median")
                                       for r in results}}
    print(json.dumps(summary), flush=True)
    return 0 if all(r["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
