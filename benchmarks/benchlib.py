"""Shared pieces of the pipeline benchmarks (async_vs_sync, queue_scheduling, prompt_replication, learning).

    python benchmarks/benchlib.py warm --out runs/bench_models/longtail_L4_H192 --num-layers 4 --hidden-size 192

* A **long-tail model**: a random-init Llama (`tools/make_tiny_model.py`) after a short supervised
  warm-up whose targets are random letters of length k with P(k) ∝ 1/k, 1 ≤ k ≤ --max-len, independent
  of the prompt. At temperature 1 the model then samples its response lengths from that long tail,
  per sample (two responses to one prompt differ in length as much as two responses to two prompts).
  Cached by its arguments under runs/bench_models/.
* **run_pipeline**: one run of the product (`launch/pretrain_async_rl.py`, its own process, which
  starts its own local engine servers) with key=value overrides; returns the rows of metrics.jsonl.
* **graded_reward** / **write_graded_data**: a verifier stand-in with a per-prompt pass rate (a data
  column), so a known share of groups has all-equal rewards and a dynamic filter drops them.
* **CpuMonitor**: the cores the trainer process (main thread vs the rest, i.e. the rollout loop), its
  engine servers and everything else on the machine got, per step, from /proc.
* **steady**: means over the steps after the first few (start-up, first weight push, JIT warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_flash.ports import free_ports  # noqa: E402  (engines use base_port + i)
MODELS_DIR = os.path.join(REPO, "runs", "bench_models")
# One product run's config: the CPU quickstart, quiet logging, no HF export at the end.
BASE_OVERRIDES = ["logging.wandb_mode=disabled", "logging.tensorboard=false", "checkpoint.save_hf_at_end=false"]


def uncorrected_opt_in(loss: str, alpha: int, *, code: str = REPO, params: Optional[dict] = None) -> list[str]:
    """["loss.allow_uncorrected=true"] for a loss without behaviour correction (its registry flag) at
    alpha > 0, which the launcher refuses without it, when the code that runs knows the key (a --compare
    revision from before it neither refuses nor knows it); else []."""
    from megatron_flash.losses import get_loss

    import glob

    config = os.path.join(code, "megatron_flash", "config")  # the schema, in one file or a module per section
    knows = any("allow_uncorrected:" in open(p).read()
                for p in [os.path.join(config, "schema.py"), *glob.glob(os.path.join(config, "sections", "*.py"))])
    return ["loss.allow_uncorrected=true"] if alpha > 0 and knows and get_loss(loss, **(params or {})).on_policy else []


def log(name: str, msg: str) -> None:
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    # A parent's torch.distributed variables would make the child join the wrong group.
    out = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out["OMP_NUM_THREADS"] = "1"
    # benchmarks/ too: the runs name this module's reward (rollout.reward=benchlib:graded_reward).
    out["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "benchmarks"), out.get("PYTHONPATH", "")])
    return out



# ------------------------------------------------------------------ models
def long_tail_lengths(rng: random.Random, max_len: int) -> int:
    ks = range(1, max_len + 1)
    return rng.choices(ks, weights=[1.0 / k for k in ks])[0]


def long_tail_model(*, num_layers: int, hidden_size: int, max_len: int, sft_steps: int = 150, seed: int = 0,
                    name: str = "bench") -> str:
    """Path of the warm long-tail model (HF dir), built on first use (≈ 0.5–1 min on the CPU box)."""
    out = os.path.join(MODELS_DIR, f"longtail_L{num_layers}_H{hidden_size}_len{max_len}_sft{sft_steps}_s{seed}")
    warm = os.path.join(out, "warm_model")
    if os.path.isfile(os.path.join(warm, "config.json")):
        return warm
    log(name, f"building the long-tail model {out} (once; cached)")
    cmd = [sys.executable, os.path.abspath(__file__), "warm", "--out", out, "--num-layers", str(num_layers),
           "--hidden-size", str(hidden_size), "--max-len", str(max_len), "--sft-steps", str(sft_steps),
           "--seed", str(seed)]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: building the long-tail model failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return warm


def quickstart_warm_model(*, seed: int = 0, name: str = "bench") -> str:
    """The quickstart's sort4 format-only warm model (launch/quickstart_cpu.py's warm-up), cached."""
    out = os.path.join(MODELS_DIR, f"sort4_quickstart_s{seed}")
    warm = os.path.join(out, "warm_model")
    if os.path.isfile(os.path.join(warm, "config.json")):
        return warm
    log(name, f"building the quickstart sort4 warm model {out} (once; cached)")
    cmd = [sys.executable, os.path.abspath(__file__), "warm", "--out", out, "--task", "sort4", "--seed", str(seed),
           "--sft-steps", "300"]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the sort4 warm-up failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return warm


class _LongTailFormat:
    """A warm-up task for launch/quickstart_cpu.py's format-only samples: countdown prompts, answers of random
    letters whose length is long-tailed and independent of the prompt."""

    def __init__(self, max_len: int) -> None:
        from megatron_flash.rewards.synthetic import get_task

        self.max_len = max_len
        self._countdown = get_task("countdown")

    def make(self, rng: random.Random) -> tuple[str, str]:
        return self._countdown.make(rng)

    def format_only(self, rng: random.Random, prompt: str) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(long_tail_lengths(rng, self.max_len)))


def _warm_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="benchlib.py warm")
    p.add_argument("--out", required=True)
    p.add_argument("--task", default="longtail", help="longtail (see module docstring) or sort4 (quickstart)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(REPO, "launch"))
    import torch
    import transformers

    torch.set_num_threads(1)
    import quickstart_cpu  # its format-only samples and export check, reused as is
    from quickstart_common import Quickstart

    tiny = os.path.join(args.out, "tiny_model")
    subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny, "--seed",
                    str(args.seed), "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size)],
                   check=True, capture_output=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    if args.task == "longtail":
        task: Any = _LongTailFormat(args.max_len)
    else:
        from megatron_flash.rewards.synthetic import get_task

        task = get_task(args.task)
    rng = random.Random(args.seed)
    warm = Quickstart("warm-up", out=args.out).warm_up(
        seed=args.seed, num_steps=args.sft_steps, batch_size=64, pad_id=tokenizer.pad_token_id,
        make_samples=lambda: quickstart_cpu.format_only_samples(task, tokenizer, rng, 64),
        loss_label="nll/token", log_every=50)
    summary = {**warm.nll(), "export_max_abs_logit_diff": quickstart_cpu.export_parity(warm.policy, warm.path)}
    print(json.dumps(summary))
    return 0


def graded_reward(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    """A verifier stand-in: 1.0 with the prompt's pass rate (data column `pass_rate`, reaching the reward
    as `meta`), else 0.0. Prompts with rate 0 or 1 always give all-equal groups (no signal)."""
    rate = float((meta or {}).get("pass_rate", 0.5))
    return 1.0 if random.random() < rate else 0.0


def write_graded_data(path: str, *, rows: int, pass_rates: Sequence[float], seed: int) -> None:
    """Countdown prompts with a `pass_rate` column drawn from pass_rates (for graded_reward)."""
    from megatron_flash.rewards.synthetic import get_task

    task, rng = get_task("countdown"), random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            prompt, answer = task.make(rng)
            f.write(json.dumps({"prompt": prompt, "answer": answer, "pass_rate": rng.choice(list(pass_rates))}) + "\n")


# ------------------------------------------------------------------ product runs
class CpuMonitor:
    """CPU seconds of one process (the trainer, or a benchmark's own client), its main thread, its child
    processes (engine servers) and the whole machine, snapshotted per step: how many cores each side
    really got. With `metrics_path` a thread snapshots each time metrics.jsonl grows by a step; else
    call `snapshot(step)`. Linux /proc only (elsewhere no numbers)."""

    def __init__(self, pid: int, metrics_path: Optional[str] = None) -> None:
        import threading

        self.pid, self.metrics_path = pid, metrics_path
        self.snapshots: list[dict[str, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True) if metrics_path else None
        if self._thread is not None:
            self._thread.start()

    def _cpu(self, path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime

    def _children(self) -> list[int]:
        out = []
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        return out

    def _machine(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / self._tick  # all but idle and iowait

    def snapshot(self, step: int) -> None:
        try:
            self.snapshots.append({
                "step": step, "wall": time.monotonic(), "proc": self._cpu(f"/proc/{self.pid}/stat"),
                "main": self._cpu(f"/proc/{self.pid}/task/{self.pid}/stat"),
                "engines": sum(self._cpu(f"/proc/{c}/stat") for c in self._children()), "machine": self._machine()})
        except (OSError, ValueError, IndexError):
            pass  # a process ended between listing and reading: skip this snapshot

    def _loop(self) -> None:
        seen = 0
        while not self._stop:
            time.sleep(0.05)
            try:
                with open(self.metrics_path) as f:
                    n = sum(1 for line in f if line.strip())
            except OSError:
                continue
            if n != seen:
                seen = n
                self.snapshot(n - 1)

    def stop(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()

    def cores(self, *, skip: int) -> dict[str, float]:
        """Mean cores from the end of step skip-1 to the last snapshot: the process (its main thread,
        its other threads, e.g. the rollout loop), its engine servers, and everything else."""
        snaps = [s for s in self.snapshots if s["step"] >= skip - 1]
        if len(snaps) < 2:
            return {}
        a, b = snaps[0], snaps[-1]
        wall = b["wall"] - a["wall"]
        d = {k: (b[k] - a[k]) / wall for k in ("proc", "main", "engines", "machine")}
        return {"cores_trainer": d["proc"], "cores_trainer_main_thread": d["main"],
                "cores_trainer_other_threads": d["proc"] - d["main"], "cores_engines": d["engines"],
                "cores_others": max(0.0, d["machine"] - d["proc"] - d["engines"])}


def checkout(rev: str, *, name: str = "bench") -> tuple[str, str]:
    """(commit, directory) of another revision's tree, exported once under runs/compare/<commit>
    (`git archive`, no worktree bookkeeping): its launcher and package run instead of this checkout's."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"{name}: --compare {rev!r} is not a commit of this repository: {err.stderr.strip()}")
    out = os.path.join(REPO, "runs", "compare", commit[:12])
    if not os.path.isfile(os.path.join(out, "launch", "pretrain_async_rl.py")):
        tmp = out + ".part"
        subprocess.run(["rm", "-rf", tmp], check=True)
        os.makedirs(tmp)
        archive = subprocess.Popen(["git", "archive", commit], cwd=REPO, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"{name}: git archive {commit} failed")
        os.replace(tmp, out)
    return commit, out


def head_label() -> str:
    """This checkout's commit, with `+dirty` when the tracked files differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "megatron_flash", "launch", "configs"],
                           cwd=REPO).returncode != 0
    return commit + ("+dirty" if dirty else "")


def run_pipeline(*, model: str, run_dir: str, overrides: Sequence[str], num_engines: int = 1,
                 config: str = "configs/quickstart_cpu.yaml", timeout_s: float = 900, name: str = "bench",
                 monitor: bool = False, code: str = REPO) -> tuple[list[dict], Optional[CpuMonitor]]:
    """One run of launch/pretrain_async_rl.py in its own process; returns metrics.jsonl's rows and,
    with monitor=True, the CPU monitor of the run. `code`: the tree whose launcher, config and package
    run (another revision's, from `checkout`); models and run directories stay where they are."""
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    for stale in (metrics, os.path.join(run_dir, "groups.jsonl")):
        if os.path.exists(stale):
            os.remove(stale)  # one run's rows, not an append of several
    cmd = [sys.executable, os.path.join(code, "launch/pretrain_async_rl.py"), "--config", os.path.join(code, config),
           f"model.hf_path={model}", f"logging.dir={run_dir}", f"engines.num_engines={num_engines}",
           f"engines.base_port={free_ports(num_engines)}", *BASE_OVERRIDES, *overrides]
    run_env = env()
    if code != REPO:  # the other tree's package first, before the installed (editable) checkout
        run_env["PYTHONPATH"] = os.pathsep.join([code, os.path.join(code, "benchmarks"), run_env["PYTHONPATH"]])
    t0 = time.monotonic()
    with open(os.path.join(run_dir, "stdout.log"), "w") as out:
        proc = subprocess.Popen(cmd, env=run_env, cwd=code, stdout=out, stderr=subprocess.STDOUT)
        mon = CpuMonitor(proc.pid, metrics) if monitor and os.path.isdir("/proc") else None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(30)
            rc = "timeout"
        finally:
            if mon is not None:
                mon.stop()
    if rc != 0:
        with open(os.path.join(run_dir, "stdout.log")) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"{name}: run failed (exit {rc}): {' '.join(cmd)}\n{tail}")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    log(name, f"{os.path.basename(run_dir)}: {len(rows)} steps in {time.monotonic() - t0:.0f} s")
    return rows, mon


def finish_reward_plot(fig: Any, axes: Sequence[Any], path: str, *, titles: Sequence[str],
                       ylabel: str = "task reward (mean over seeds)") -> None:
    """The reward-curve figures' common frame (steps of 128 samples, reward 0–1, grid, legend), saved
    to `path` (folders made) and closed."""
    for ax, title in zip(axes, titles):
        ax.set_xlabel("train step (128 samples each)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


def add_engine_device_args(p: argparse.ArgumentParser) -> None:
    """--engine-device / --engine-dtype: where the local engine decodes (its --device / --dtype)."""
    p.add_argument("--engine-device", default="cpu", help="local engine device: cpu, cuda, cuda:N")
    p.add_argument("--engine-dtype", default="", help="local engine dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--engine-decoder", default="static", choices=["static", "cb"], help="local engine decoder")
    p.add_argument("--decode-step-ms", type=float, default=0.0, metavar="T",
                   help="local engine --decode-step-ms: every decode step lasts at least T ms for 1 to max_running "
                        "sequences, as on a GPU (latency injection; 0: off, the CPU's own step cost)")


def engine_device_server_args(args: argparse.Namespace) -> dict[str, Any]:
    dtype = args.engine_dtype or ("float32" if args.engine_device == "cpu" else "bfloat16")
    out: dict[str, Any] = {"device": args.engine_device, "dtype": dtype, "decoder": args.engine_decoder}
    if args.decode_step_ms:  # only when set: the engines of a plain run get the flags they always got
        out["decode_step_ms"] = args.decode_step_ms
    return out


def engine_capacity_server_args(args: argparse.Namespace, *, max_running: int, request_tokens: int,
                                num_blocks: int = 0) -> dict[str, int]:
    """How many requests an engine runs at once, each up to `request_tokens` (prompt + new tokens), in
    the flags of its decoder: slots for static; KV pages of 16 tokens (`num_blocks`, default: room for
    `max_running` worst cases) and tokens per step for cb."""
    if args.engine_decoder == "static":
        return {"max_running_requests": max_running, "context_length": request_tokens}
    return {"num_blocks": num_blocks or max_running * -(-request_tokens // 16), "max_batch_tokens": 512}


def steady(rows: Sequence[dict], *, skip: int, keys: Sequence[str]) -> dict[str, float]:
    """Mean of each key over rows[skip:] (None values ignored)."""
    out = {}
    for k in keys:
        vals = [r[k] for r in rows[skip:] if r.get(k) is not None]
        out[k] = statistics.fmean(vals) if vals else float("nan")
    return out


def round_mean(runs: Sequence[dict], key: str) -> float:
    """Mean of `key` over the rounds of one mode (rounds lacking it ignored), 4 decimals."""
    vals = [s[key] for s in runs if key in s]
    return round(statistics.fmean(vals), 4) if vals else float("nan")


def speedup_fields(slow: Sequence[dict], fast: Sequence[dict]) -> dict[str, Any]:
    """time_step of `slow` over `fast`: per round, their median, and the ratio of the mean step times.
    Runs of one round are back to back, so they share the load of other work on the machine: the
    per-round ratios and their median are steadier than the ratio of means when that load varies."""
    per_round = [x["time_step"] / y["time_step"] for x, y in zip(slow, fast)]
    return {"speedup_per_round": [round(v, 3) for v in per_round],
            "speedup_median": round(statistics.median(per_round), 3),
            "speedup": round(round_mean(slow, "time_step") / round_mean(fast, "time_step"), 3)}


def uptime_load() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "warm":
        sys.exit(_warm_main(sys.argv[2:]))
    print(__doc__)
