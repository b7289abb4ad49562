"""Soak: the quickstart product for M minutes on the CPU box, faults injected on a schedule, the whole
process tree sampled from /proc, every aim of issue 37 checked at the end (docs/benchmarks.md "Soak").

    nice -n 19 .venv/bin/python benchmarks/soak.py --minutes 60                  # plot: docs/img/soak.png
    nice -n 19 .venv/bin/python benchmarks/soak.py --minutes 3 --compressed      # 2 kills, 2 timeouts, a cut
    nice -n 19 .venv/bin/python benchmarks/soak.py --minutes 2 --compressed      # CI: tests/e2e/test_soak.py

The run: `launch/pretrain_async_rl.py --config configs/quickstart_cpu.yaml` on benchlib's warm sort4 model
(one launched local engine, α = 2, tis), with the soak's settings on top (`SOAK_OVERRIDES`: rewards in 2
worker processes with a 2 s deadline, a checkpoint every 200 steps and resume on, restarts unbounded,
steps enough to outlast M minutes). Its clock starts at the run's first metrics row (start-up, 10 s on a
quiet box and a minute or more on a loaded one, comes before it) and runs M minutes; W = the warm-up
(5 min, or the first third with --compressed), F = 0.85 M (faults stop, so the counters can catch up
before the end). A fault falls due at its time once the current trainer has logged 3 rows.

Faults (`plan`):
  * the trainer gets SIGTERM at W/2 (it saves and exits) and is started again with the same command,
    resuming from the checkpoint;
  * between W and F, evenly spaced: engine kills (SIGKILL of engine 0 by its pid file; every 5 min,
    with --compressed one per 1.5 min: 2 in 3 minutes, 1 in 2), reward timeouts (a token file that the next reward call takes and then hangs
    on; as many as kills) and one weight sync cut mid-transfer (the product's MF_FAULT_CUT_SYNC_FILE
    hook, megatron_flash/weight_sync/fault_injection.py);
  * between W and F, each reward call raises with probability --reward-error-rate.
The reward (`faulty_exact_match`, run in the trainer's reward workers) appends one line per injected
reward fault to <out>/faults/reward_faults.log. Samples every --sample-s: RSS, threads and fds per
role, children, shared memory (soak_probe.py), into <out>/samples.csv.

Aims, measured after W (each printed with its value in the last line, a JSON object): trainer RSS
growth ≤ 5 %; tree fds, threads, shared-memory objects flat within a constant; no process of the run
alive after it stops; the accounting identity exact on every row; every injected fault counted (kills
= Σ engines_restarted, reward errors = Σ reward_errors, timeouts = Σ reward_timeouts, the cut sync =
Σ engines_resynced, the resume = rows continuing at the next step); reward still rising at the end
(the last tenth of steps at least the first 5 steps + 0.3 and within 0.05 of the best earlier tenth); step
times outside the fault windows: p99 ≤ 3× the median, and no stall (a step over 10× the median; --stall-s S
stops the trainer S seconds once to show that these fail). Exit code 0 only when all pass
(--report-only: always 0). A finished soak keeps its record in <out>/state.json: --evaluate-only
evaluates it again (soak_aims.py) without a run. Not injected here: attached engines (their restart
loop is tests/e2e/test_engine_faults.py's) and rollout.runner=process (pass it as an override).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BASE_OVERRIDES, REPO, env, free_ports, log, quickstart_warm_model, uptime_load  # noqa: E402

NAME = "soak"
FAULT_DIR_ENV, ERROR_RATE_ENV = "SOAK_FAULT_DIR", "SOAK_REWARD_ERROR_RATE"
REWARD_TIMEOUT_S = 2.0
SOAK_OVERRIDES = ["trainer.total_steps=1000000", "rollout.reward=soak:faulty_exact_match", "rollout.reward_workers=2",
                  f"rollout.reward_timeout_s={REWARD_TIMEOUT_S}", "engines.max_restarts=1000",
                  "checkpoint.save_interval=200", "checkpoint.resume=true"]
DROPS = ("dropped_stale", "regenerated_stale", "dropped_filtered", "reward_failed", "dropped_error",
         "samples_cancelled", "samples_skipped")


# ------------------------------------------------------------------ the reward, in the reward workers
def _note(fault_dir: str, kind: str) -> None:
    fd = os.open(os.path.join(fault_dir, "reward_faults.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{kind} {time.time():.3f}\n".encode())  # one write with O_APPEND: whole lines
    finally:
        os.close(fd)


def faulty_exact_match(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    """The quickstart's exact_match, with the soak's injected faults (see the module docstring)."""
    fault_dir = os.environ.get(FAULT_DIR_ENV, "")
    if fault_dir:
        try:
            os.remove(os.path.join(fault_dir, "timeout_next"))  # only one call wins the token
            _note(fault_dir, "timeout")
            time.sleep(3600)  # killed with its worker at rollout.reward_timeout_s
        except FileNotFoundError:
            pass
        if os.path.exists(os.path.join(fault_dir, "errors_on")) and random.random() < float(os.environ[ERROR_RATE_ENV]):
            _note(fault_dir, "error")
            raise RuntimeError("soak: injected reward error")
    from megatron_flash.rewards.synthetic import exact_match_reward

    return exact_match_reward(response_text, answer, finished=finished)


# ------------------------------------------------------------------ the schedule
@dataclass
class Plan:
    total_s: float
    warmup_s: float
    faults_end_s: float
    sigterm_s: float
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds from launch, kill|timeout|cut)


def plan(minutes: float, *, compressed: bool, stall: bool = False) -> Plan:
    total = minutes * 60.0
    warmup = total / 3 if compressed else 300.0
    end = 0.85 * total
    if end - warmup < 30:
        raise ValueError(f"--minutes {minutes}: too short for a warm-up of {warmup:.0f} s and faults after it "
                         "(use at least 3 with --compressed, 8 without)")
    # compressed: one kill (and timeout) per 1.5 minutes, so that the steady samples between the faults'
    # windows stay enough for the RSS and flatness aims (2 minutes: 1, tests/e2e/test_soak.py; 3: 2)
    kills = max(1, int(minutes // 1.5)) if compressed else max(1, int((end - warmup) // 300))
    kinds = [k for _ in range(kills) for k in ("kill", "timeout")]
    kinds.insert(len(kinds) // 2, "cut")  # the cut sync between two kills, away from both
    if stall:  # the check of the step-time aims: first, so that no fault's window covers it
        kinds.insert(0, "stall")
    gap = (end - warmup) / len(kinds)
    return Plan(total, warmup, end, warmup / 2, [(warmup + (i + 0.5) * gap, k) for i, k in enumerate(kinds)])


# ------------------------------------------------------------------ the run
class Soak:
    def __init__(self, args: argparse.Namespace, p: Plan) -> None:
        from soak_probe import TreeProbe

        self.args, self.plan = args, p
        self.out = os.path.abspath(args.out)
        self.run_dir, self.fault_dir = os.path.join(self.out, "run"), os.path.join(self.out, "faults")
        for d in (self.run_dir, self.fault_dir):
            subprocess.run(["rm", "-rf", d], check=True)
            os.makedirs(d)
        self.probe = TreeProbe(rollout_process="rollout.runner=process" in args.overrides)
        self.model = quickstart_warm_model(seed=args.seed, name=NAME)
        self.proc: Optional[subprocess.Popen] = None
        self.t0 = 0.0
        self.rows: list[dict[str, Any]] = []  # each with _t (arrival, s from launch) and _segment
        self.samples: list[dict[str, float]] = []
        self.faults: list[dict[str, Any]] = []  # {"t", "kind", ...} as injected
        self.notes: list[str] = []
        self._offset = 0
        self.segment = 0
        self.startup_s = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        from megatron_flash.engines.launcher_processes import die_with_parent

        run_env = {**env(), FAULT_DIR_ENV: self.fault_dir, ERROR_RATE_ENV: str(self.args.reward_error_rate),
                   "MF_FAULT_CUT_SYNC_FILE": os.path.join(self.fault_dir, "cut_sync")}
        cmd = [sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config",
               os.path.join(REPO, "configs/quickstart_cpu.yaml"), f"model.hf_path={self.model}",
               f"logging.dir={self.run_dir}", f"engines.base_port={free_ports(1)}", *BASE_OVERRIDES, *SOAK_OVERRIDES,
               f"checkpoint.save_dir={os.path.join(self.run_dir, 'ckpt')}", *self.args.overrides]
        with open(os.path.join(self.out, "stdout.log"), "a") as f:
            # SIGTERM from the kernel if this process dies (a CI timeout kills it): no trainer left behind.
            self.proc = subprocess.Popen(cmd, env=run_env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        log(NAME, f"segment {self.segment}: trainer pid {self.proc.pid}")

    def stop(self, *, timeout_s: float = 180.0) -> Optional[int]:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.notes.append(f"trainer {self.proc.pid} still running {timeout_s:.0f} s after SIGTERM: killed")
            self.proc.kill()
            self.proc.wait()
            return None

    def read_rows(self) -> None:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return
        with open(path) as f:
            f.seek(self._offset)
            text = f.read()
        done = text[:text.rfind("\n") + 1]  # whole lines only: a row being written waits for the next read
        self._offset += len(done.encode())
        for line in done.splitlines():
            if line.strip():
                self.rows.append({**json.loads(line), "_t": self.now(), "_segment": self.segment})

    def sample(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            row = self.probe.sample(self.proc.pid)
            if row:
                self.samples.append({"t": self.now(), "segment": self.segment, "steps": len(self.rows), **row})

    def inject(self, kind: str) -> None:
        t = self.now()
        if kind == "kill":
            with open(os.path.join(self.run_dir, "engines", "engine_0.pid")) as f:
                pid = int(f.read())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # not counted as injected: the fault ledger would not match
                self.notes.append(f"engine kill at {t:.0f} s: pid {pid} (engine_0.pid) was not running")
                return
            self.faults.append({"t": t, "kind": kind, "pid": pid})
        elif kind == "timeout":
            open(os.path.join(self.fault_dir, "timeout_next"), "w").close()
            self.faults.append({"t": t, "kind": kind})
        elif kind == "cut":
            open(os.path.join(self.fault_dir, "cut_sync"), "w").close()
            self.faults.append({"t": t, "kind": kind})
        elif kind == "stall":  # the whole trainer (its rollout side too) stops, engines go on: no window
            os.kill(self.proc.pid, signal.SIGSTOP)
            time.sleep(self.args.stall_s)
            os.kill(self.proc.pid, signal.SIGCONT)
            self.faults.append({"t": t, "kind": kind, "seconds": self.args.stall_s})
        elif kind == "errors_on":
            open(os.path.join(self.fault_dir, "errors_on"), "w").close()
        elif kind == "errors_off":
            os.remove(os.path.join(self.fault_dir, "errors_on"))
        log(NAME, f"{t:7.1f} s: {kind}")

    def wait_first_row(self, timeout_s: float = 600.0) -> None:
        """The soak's clock starts at the run's first metrics row, not at its launch: start-up takes 10 s on a
        quiet box and over a minute on a loaded one, and the plan is in seconds of training."""
        while not self.rows and self.proc.poll() is None and self.now() < timeout_s:
            self.sample()
            time.sleep(0.5)
            self.read_rows()
        shift = self.rows[0]["_t"] if self.rows else self.now()
        self.t0 += shift
        for x in (*self.rows, *self.samples):
            x["_t" if "_t" in x else "t"] -= shift
        self.startup_s = shift

    def resume(self) -> None:
        t = self.now()
        steps = len(self.rows)
        rc = self.stop()
        self.read_rows()
        self.faults.append({"t": t, "kind": "sigterm", "exit_code": rc, "rows_before": len(self.rows),
                            "last_step": self.rows[-1]["step"] if self.rows else None})
        log(NAME, f"{t:7.1f} s: SIGTERM after {steps} rows: exit {rc}; starting again")
        self.segment += 1
        self.start()

    def run(self) -> None:
        p, a = self.plan, self.args
        todo = sorted([(p.sigterm_s, "sigterm"), (p.warmup_s, "errors_on"), (p.faults_end_s, "errors_off"),
                       *p.events])
        self.t0 = time.monotonic()
        self.start()
        self.wait_first_row()
        next_sample = 0.0
        while self.now() < p.total_s:
            self.read_rows()
            if self.proc.poll() is not None:
                self.notes.append(f"the trainer exited by itself with code {self.proc.returncode} at "
                                  f"{self.now():.0f} s (stdout.log)")
                break
            # A fault is due once its time has come and the current trainer trains: a resumed one that is
            # still starting (slow on a loaded box) has no engine to kill yet, nothing to cut.
            training = sum(r["_segment"] == self.segment for r in self.rows) >= 3
            while todo and todo[0][0] <= self.now() and training:
                _, kind = todo.pop(0)
                if kind == "sigterm":
                    self.resume()
                    break
                self.inject(kind)
            if self.now() >= next_sample:
                self.sample()
                next_sample += a.sample_s
            time.sleep(0.2)
        self.sample()  # the last sample, just before the stop
        if self.proc.poll() is None:
            rc = self.stop()
            if rc != 0:
                self.notes.append(f"the final SIGTERM ended the trainer with code {rc}")
        self.read_rows()
        time.sleep(10)  # the kernel's parent-death signals and the engines' own shutdown
        self.survivors = self.probe.survivors()
        self.shm_left = self.probe.dev_shm_left()
        with open(os.path.join(self.fault_dir, "reward_faults.log"), "a+") as f:
            f.seek(0)
            self.reward_faults = [line.split()[0] for line in f if line.strip()]


def write_csv(path: str, samples: list[dict[str, float]]) -> None:
    import csv

    keys = list(dict.fromkeys(k for s in samples for k in s))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(samples)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the whole soak, launch to stop")
    ap.add_argument("--compressed", action="store_true", help="short versions: warm-up = first third, a kill per 1.5 min")
    ap.add_argument("--out", default="", help="output directory (default runs/soak, runs/soak_compressed)")
    ap.add_argument("--sample-s", type=float, default=0.0, help="seconds between samples (default 60; 2 compressed)")
    ap.add_argument("--reward-error-rate", type=float, default=0.002, help="P(a reward call raises) between W and F")
    ap.add_argument("--plot", default="", help="plot path (default docs/img/soak.png, or <out>/soak.png compressed)")
    ap.add_argument("--seed", type=int, default=0, help="the warm model's seed (benchlib.quickstart_warm_model)")
    ap.add_argument("--report-only", action="store_true", help="exit 0 even when an aim fails")
    ap.add_argument("--stall-s", type=float, default=0.0,
                    help="stop the trainer (SIGSTOP) this long once, between the faults: the step-time aims must fail")
    ap.add_argument("--evaluate-only", action="store_true",
                    help="no run: the aims and plot again from <out>/state.json of a finished soak")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the product run")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or not 0.0 <= args.reward_error_rate < 1.0:
        raise SystemExit(f"{NAME}: --minutes must be > 0 and --reward-error-rate in [0, 1), got "
                         f"{args.minutes}, {args.reward_error_rate}")
    args.out = args.out or os.path.join(REPO, "runs", "soak_compressed" if args.compressed else "soak")
    args.sample_s = args.sample_s or (2.0 if args.compressed else 60.0)
    args.plot = args.plot or (os.path.join(args.out, "soak.png") if args.compressed
                              else os.path.join(REPO, "docs", "img", "soak.png"))
    try:
        p = plan(args.minutes, compressed=args.compressed, stall=args.stall_s > 0)
    except ValueError as error:
        raise SystemExit(f"{NAME}: {error}")
    from soak_aims import evaluate, plot

    state = os.path.join(args.out, "state.json")
    if args.evaluate_only:  # the aims again, from a finished soak's record (e.g. after changing soak_aims.py)
        with open(state) as f:
            soak: Any = argparse.Namespace(**json.load(f))
        soak.plan = Plan(**soak.plan)
        from soak_probe import unheld

        soak.shm_left = unheld(set(soak.shm_left))  # held now (by later work) or gone: not this run's leak
    else:
        soak = Soak(args, p)
        log(NAME, f"{args.minutes:g} min, warm-up {p.warmup_s:.0f} s, faults at "
                  + ", ".join(f"{t:.0f} s {k}" for t, k in [(p.sigterm_s, "sigterm"), *p.events]))
        soak.run()
        write_csv(os.path.join(soak.out, "samples.csv"), soak.samples)
        keep = ("out", "rows", "samples", "faults", "notes", "survivors", "shm_left", "reward_faults", "startup_s")
        with open(state, "w") as f:
            json.dump({"plan": vars(soak.plan), **{k: getattr(soak, k) for k in keep}}, f)
    result = evaluate(soak, reward_timeout_s=REWARD_TIMEOUT_S, drops=DROPS)
    result.update(minutes=args.minutes, compressed=args.compressed, startup_s=round(soak.startup_s, 1),
                  load_at_end=uptime_load(), out=soak.out)
    plot(soak, args.plot)
    with open(os.path.join(soak.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0 if result["passed"] or args.report_only else 1


if __name__ == "__main__":
    sys.exit(main())
