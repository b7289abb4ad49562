"""The aims of benchmarks/soak.py, from what a soak recorded (its rows, samples, faults), and its plot.

Each aim is {"value", "limit", "pass"}; `evaluate` also returns the fault ledger (injected vs counted)
and `passed`, true only when every aim passes. Where a number is taken "after the warm-up", the base
is the median of the first three samples after W and the end the median of the last three, of the
samples outside every fault's window (one taken mid-restart of an engine or a reward worker would
count a missing process as a change).
"""

from __future__ import annotations

import statistics
from typing import Any

FLAT_LIMITS = {"fds_total": 16, "threads_total": 8, "shm_tree": 2, "children": 0}
"""How far the tree's totals may move between the base and the end after the warm-up."""
RSS_GROWTH_LIMIT = 0.05
P99_RATIO_LIMIT = 3.0
"""Step-time spread outside fault windows: the 99th percentile over the median."""
STALL_RATIO = 10.0
"""A stall: one step over this many medians outside every fault window. One slow step of a few medians
is the box (a 3-min soak on a quiet box saw 3.6x once); a step that stops for seconds is not."""
REWARD_GAIN, REWARD_SLACK = 0.3, 0.05
TIMEOUT_EFFECT_S = 15.0
"""After a reward timeout's deadline: its worker is replaced (a spawned process importing the reward)."""


def _aim(value: Any, limit: Any, ok: bool) -> dict[str, Any]:
    return {"value": value, "limit": limit, "pass": bool(ok)}


def _ends(samples: list[dict], key: str) -> tuple[float, float]:
    return statistics.median(s[key] for s in samples[:3]), statistics.median(s[key] for s in samples[-3:])


def _first_row_after(rows: list[dict], t: float, key: str, end: float) -> float:
    return next((r["_t"] for r in rows if r["_t"] > t and r.get(key)), end)


def fault_windows(soak: Any, *, reward_timeout_s: float) -> list[tuple[float, float, str]]:
    """(start, end, kind) of each injected fault's effect on the run, in seconds from the launch."""
    end, rows, out = soak.plan.total_s, soak.rows, []
    for f in soak.faults:
        t = f["t"]
        if f["kind"] == "kill":  # until the push that re-synced the restarted engine
            out.append((t, _first_row_after(rows, t, "engines_restarted", end), "kill"))
        elif f["kind"] == "cut":
            out.append((t, _first_row_after(rows, t, "engines_resynced", end), "cut"))
        elif f["kind"] == "timeout":
            out.append((t, t + reward_timeout_s + TIMEOUT_EFFECT_S, "timeout"))
        elif f["kind"] == "sigterm":  # down, start-up, and the resumed run's first steps
            resumed = [r for r in rows if r["_segment"] > 0]
            out.append((t, resumed[min(2, len(resumed) - 1)]["_t"] if resumed else end, "sigterm"))
    return out


def evaluate(soak: Any, *, reward_timeout_s: float, drops: tuple[str, ...]) -> dict[str, Any]:
    p, rows, aims, ledger = soak.plan, soak.rows, {}, {}
    w = p.warmup_s
    windows = fault_windows(soak, reward_timeout_s=reward_timeout_s)
    last_segment = max((s["segment"] for s in soak.samples), default=0)
    # Samples of the steady run: an engine mid-restart or a reward worker being replaced is a process
    # missing from the tree for seconds, not a trend (those moments are in the CSV and the plot).
    after = [s for s in soak.samples if s["t"] >= w and s["segment"] == last_segment
             and not any(a - 2 <= s["t"] <= b + 5 for a, b, _ in windows)]
    if len(after) >= 6:
        base, end = _ends(after, "trainer_rss_mb")
        aims["trainer_rss_growth"] = _aim(round(end / base - 1, 4), RSS_GROWTH_LIMIT, end / base - 1 <= RSS_GROWTH_LIMIT)
        aims["trainer_rss_mb"] = _aim([round(base, 1), round(end, 1)], "base, end", True)
        for key, limit in FLAT_LIMITS.items():
            b, e = _ends(after, key)
            peak = max(s[key] for s in after)
            aims[f"flat_{key}"] = _aim({"base": b, "end": e, "max": peak}, f"|end - base| <= {limit}",
                                       abs(e - b) <= limit)
    else:
        aims["samples_after_warmup"] = _aim(len(after), ">= 6", False)
    aims["orphans"] = _aim(soak.survivors, "none", not soak.survivors)
    aims["dev_shm_left"] = _aim(soak.shm_left, "none", not soak.shm_left)
    if soak.notes:
        aims["run_ended_as_planned"] = _aim(soak.notes, "no notes", False)

    bad = [r["step"] for r in rows
           if r["samples_admitted"] != r["samples_trained"] + r["samples_outstanding"] + sum(r[k] for k in drops)]
    aims["accounting_identity"] = _aim({"rows": len(rows), "violations": bad[:10]}, "0 violations", not bad and rows)
    steps = [r["step"] for r in rows]
    aims["steps_once_in_order"] = _aim(len(steps), "0, 1, 2, ...", steps == list(range(len(steps))) and steps)

    # ---- every injected fault counted by the metric that counts it
    total = lambda key: sum(r.get(key) or 0 for r in rows)  # noqa: E731
    kills = sum(f["kind"] == "kill" for f in soak.faults)
    ledger["engine_kills"] = {"injected": kills, "engines_restarted": total("engines_restarted"),
                              "engine_restarts_per_segment": [max((r.get("engine_restarts") or 0 for r in rows
                                                                   if r["_segment"] == s), default=0)
                                                              for s in range(last_segment + 1)]}
    ledger["reward_errors"] = {"injected": soak.reward_faults.count("error"), "reward_errors": total("reward_errors")}
    ledger["reward_timeouts"] = {"tokens_placed": sum(f["kind"] == "timeout" for f in soak.faults),
                                 "injected": soak.reward_faults.count("timeout"),
                                 "reward_timeouts": total("reward_timeouts")}
    ledger["sync_cut"] = {"injected": sum(f["kind"] == "cut" for f in soak.faults),
                          "engines_resynced": total("engines_resynced")}
    term = [f for f in soak.faults if f["kind"] == "sigterm"]
    resumed = [r for r in rows if r["_segment"] > 0]
    ledger["trainer_sigterm"] = {"injected": len(term), "exit_code": term[0]["exit_code"] if term else None,
                                 "last_step_before": term[0]["last_step"] if term else None,
                                 "first_step_after": resumed[0]["step"] if resumed else None}
    counted = {
        "engine_kills": kills > 0 and ledger["engine_kills"]["engines_restarted"] == kills
        and sum(ledger["engine_kills"]["engine_restarts_per_segment"]) == kills,
        "reward_errors": ledger["reward_errors"]["injected"] > 0
        and ledger["reward_errors"]["injected"] == ledger["reward_errors"]["reward_errors"],
        "reward_timeouts": ledger["reward_timeouts"]["injected"] == ledger["reward_timeouts"]["tokens_placed"] > 0
        and ledger["reward_timeouts"]["reward_timeouts"] == ledger["reward_timeouts"]["injected"],
        "sync_cut": ledger["sync_cut"]["injected"] == 1 and ledger["sync_cut"]["engines_resynced"] == 1,
        "trainer_sigterm": len(term) == 1 and term[0]["exit_code"] == 0 and bool(resumed)
        and ledger["trainer_sigterm"]["first_step_after"] == ledger["trainer_sigterm"]["last_step_before"] + 1,
    }
    aims["faults_counted"] = _aim({k: v for k, v in counted.items()}, "all true", all(counted.values()))

    # ---- reward still rising (or holding its best) at the end
    rewards = [r["reward_mean"] for r in rows]
    if len(rewards) >= 20:
        k = len(rewards) // 10
        tenths = [statistics.fmean(rewards[i * k:(i + 1) * k]) for i in range(10)]
        last = statistics.fmean(rewards[-k:])
        # learned from where it started (the first 5 steps: the warm model), not from the first tenth,
        # which on a fast box already holds most of the rise; and held its best to the end
        start = statistics.fmean(rewards[:5])
        ok = last >= start + REWARD_GAIN and last >= max(tenths[:-1]) - REWARD_SLACK
        aims["reward_rising_at_end"] = _aim(
            {"start": round(start, 3), "tenths": [round(x, 3) for x in tenths], "last": round(last, 3)},
            f"last >= start + {REWARD_GAIN} and >= best earlier tenth - {REWARD_SLACK}", ok)
    else:
        aims["reward_rising_at_end"] = _aim(len(rewards), ">= 20 rows", False)

    aims.update(step_time_aims(rows, windows, warmup_s=w))
    return {"passed": all(a["pass"] for a in aims.values()), "aims": aims, "faults": ledger,
            "fault_windows": [(round(a, 1), round(b, 1), k) for a, b, k in windows], "rows": len(rows),
            "samples": len(soak.samples), "plan": {"warmup_s": w, "faults_end_s": p.faults_end_s,
                                                   "sigterm_s": p.sigterm_s, "events": p.events}}


def step_time_aims(rows: list[dict], windows: list[tuple[float, float, str]], *, warmup_s: float) -> dict[str, Any]:
    """Step times after the warm-up, those whose window holds a fault set aside: their spread (p99 over
    the median) and the stalls (steps over STALL_RATIO medians; an injected --stall-s is one)."""
    measured = [r for r in rows if r["_t"] - r["time_step"] >= warmup_s]
    hit = lambda r: any(a <= r["_t"] + 0.5 and r["_t"] - r["time_step"] - 0.5 <= b for a, b, _ in windows)  # noqa: E731
    clean = sorted(r["time_step"] for r in measured if not hit(r))
    if len(clean) < 20:
        return {"step_time_p99_over_median": _aim(len(clean), ">= 20 steps outside fault windows", False),
                "step_time_stalls": _aim(None, 0, False)}
    med = statistics.median(clean)
    p99 = clean[min(len(clean) - 1, int(0.99 * len(clean)))]
    stalls = [round(t, 3) for t in clean if t > STALL_RATIO * med]
    return {
        "step_time_p99_over_median": _aim(
            {"median_s": round(med, 3), "p99_s": round(p99, 3), "ratio": round(p99 / med, 2),
             "max_s": round(clean[-1], 3), "max_ratio": round(clean[-1] / med, 2), "steps": len(clean),
             "set_aside": len(measured) - len(clean)}, P99_RATIO_LIMIT, p99 <= P99_RATIO_LIMIT * med),
        "step_time_stalls": _aim({"steps_over": stalls, "threshold_s": round(STALL_RATIO * med, 3)},
                                 f"0 steps over {STALL_RATIO:g} x median", not stalls),
    }


def plot(soak: Any, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows = soak.samples, soak.rows
    if not s:
        return
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for role in ("trainer", "engine", "reward_worker", "mp_tracker", "other"):
        if any(x[f"{role}_n"] for x in s):
            ax[0].plot(t, [x[f"{role}_rss_mb"] for x in s], label=role)
    ax[0].set_ylabel("RSS (MB)")
    for key in ("fds_total", "threads_total"):
        ax[1].plot(t, [x[key] for x in s], label=key)
    ax[1].set_ylabel("count")
    for key in ("shm_tree", "dev_shm_new", "children"):
        ax[2].plot(t, [x[key] for x in s], label=key)
    ax[2].set_ylabel("count")
    ax[3].plot([r["_t"] / 60 for r in rows], [r["reward_mean"] for r in rows], ".", ms=2, label="reward_mean")
    ax[3].set_ylabel("reward")
    ax3 = ax[3].twinx()
    ax3.plot([r["_t"] / 60 for r in rows], [r["time_step"] for r in rows], ".", ms=2, color="grey", label="time_step")
    ax3.set_ylabel("step time (s)")
    ax3.set_yscale("log")
    colors = {"kill": "red", "timeout": "orange", "cut": "purple", "sigterm": "black", "stall": "brown"}
    for f in soak.faults:
        for a in ax:
            a.axvline(f["t"] / 60, color=colors[f["kind"]], alpha=0.4, lw=1)
    for a in ax:
        a.axvline(soak.plan.warmup_s / 60, color="green", ls="--", lw=1)
        a.legend(loc="upper left", fontsize=7)
    ax[0].set_title("soak: lines = faults (red kill, orange reward timeout, purple sync cut, black SIGTERM); "
                    "green = end of warm-up", fontsize=8)
    ax[3].set_xlabel("minutes from the first step (start-up before 0)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
