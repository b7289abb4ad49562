"""One self-contained HTML page about a finished (or running) run, from its run directory alone.

    python tools/report.py runs/quickstart/rl                  # → runs/quickstart/rl/report.html
    python tools/report.py RUN_DIR --out report.html

Sections (each a <section id=...> with one embedded PNG, or a line saying why there is none):
  reward       reward_mean per step (and its running mean)
  eval         eval.jsonl: each held-out set's pass@k / mean@k per evaluated step
  staleness    how many trained samples were k versions old (staleness/samples_k, summed over steps)
  stage-times  per step, stacked: batch wait, train, weight sync, post-sync probe, the rest of the step
  engine-busy  1 − engine_idle_frac and pipeline/overlap per step
  throughput   generated tokens/s and trained samples/s (and the trainer's tokens/s per GPU)
  mfu          train/mfu per step ("not reported" where the run has no known peak, e.g. on CPU)
  lengths      response lengths of trained vs dropped (stale, filtered) samples per step
  fleet        engines in the rollout fleet per step, and how many joined and left (engines.join_port);
               the summary adds min / max / last and the requests re-issued from engines that left
  config       the resolved config the run wrote (config.yaml)
Images are PNGs (matplotlib, Agg) inlined as base64: the page opens offline, alone. The metrics are
those of docs/observability.md. Last line printed: the report's path.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys
from typing import Any, Callable, Optional

SECTIONS = ("reward", "eval", "staleness", "stage-times", "engine-busy", "throughput", "mfu", "lengths", "fleet",
            "config")
STAGES = (("wait", "batch wait (time_rollout_wait)"), ("train", "π_prox + optimizer steps (time_train)"),
          ("sync", "weight push (time_sync − time_probe)"), ("probe", "post-sync probe (time_probe)"),
          ("other", "evaluation, logging (the rest of time_step)"))


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where `key` is a number."""
    pairs = [(r["step"], r[key]) for r in rows
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def stage_times(rows: list[dict]) -> dict[str, list[float]]:
    """Per step, the seconds of each of STAGES; `other` is what time_step has beyond the rest."""
    out: dict[str, list[float]] = {name: [] for name, _ in STAGES}
    for r in rows:
        wait, train = r.get("time_rollout_wait") or 0.0, r.get("time_train") or 0.0
        probe = r.get("time_probe") or 0.0
        sync = max(0.0, (r.get("time_sync") or 0.0) - probe)
        other = max(0.0, (r.get("time_step") or 0.0) - wait - train - sync - probe)
        for name, value in zip(("wait", "train", "sync", "probe", "other"), (wait, train, sync, probe, other)):
            out[name].append(value)
    return out


def staleness_counts(rows: list[dict]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("staleness/samples_") and isinstance(value, int):
                lag = int(key.rsplit("_", 1)[1])
                counts[lag] = counts.get(lag, 0) + value
    return dict(sorted(counts.items()))


# ------------------------------------------------------------------ figures
def _png(draw: Callable[[Any], Optional[str]]) -> tuple[Optional[str], Optional[str]]:
    """(base64 PNG, None) of what `draw(ax)` plots, or (None, why) when it returns a reason instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=80)
    try:
        why = draw(ax)
        if why:
            return None, why
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return base64.b64encode(buf.getvalue()).decode(), None
    finally:
        plt.close(fig)


def figures(rows: list[dict], evals: list[dict]) -> dict[str, tuple[Optional[str], Optional[str]]]:
    """section id → (base64 PNG or None, a note: why there is no figure)."""

    def reward(ax: Any) -> Optional[str]:
        steps, values = series(rows, "reward_mean")
        if not steps:
            return "no reward_mean in metrics.jsonl"
        ax.plot(steps, values, ".-", lw=1, label="reward_mean")
        k = max(1, len(values) // 10)
        windows = [values[max(0, i - k + 1):i + 1] for i in range(len(values))]
        running = [sum(w) / len(w) for w in windows]
        ax.plot(steps, running, lw=2, label=f"running mean ({k} steps)")
        ax.set(xlabel="step", ylabel="reward")
        return None

    def evaluation(ax: Any) -> Optional[str]:
        keys = sorted({k for r in evals for k in r if k.startswith("eval/") and ("pass@" in k or "mean@" in k)})
        if not keys:
            return "no evaluation in this run (eval.datasets is empty, or eval.jsonl is missing)"
        for key in keys:
            steps, values = series(evals, key)
            ax.plot(steps, values, "o-", label=key.removeprefix("eval/"))
        ax.set(xlabel="step (weights after it)", ylabel="score")
        return None

    def staleness(ax: Any) -> Optional[str]:
        counts = staleness_counts(rows)
        if not counts:
            return "no staleness/samples_k metrics in metrics.jsonl (a run older than them)"
        ax.bar([str(k) for k in counts], list(counts.values()), color="tab:purple")
        ax.set(xlabel="staleness (policy versions between the sample's start and the step that trained it)",
               ylabel="trained samples")
        return None

    def stages(ax: Any) -> Optional[str]:
        steps = [r["step"] for r in rows]
        if not steps:
            return "no steps"
        bottom = [0.0] * len(steps)
        for (name, label), values in zip(STAGES, stage_times(rows).values()):
            ax.bar(steps, values, bottom=bottom, label=label, width=0.85)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(xlabel="step", ylabel="seconds")
        return None

    def busy(ax: Any) -> Optional[str]:
        steps, idle = series(rows, "engine_idle_frac")
        if not steps:
            return "no engine metrics (a train-only run has no engines)"
        ax.plot(steps, [1 - v for v in idle], ".-", label="engine busy (1 − engine_idle_frac)")
        o_steps, overlap = series(rows, "pipeline/overlap")
        if o_steps:
            ax.plot(o_steps, overlap, ".-", label="pipeline/overlap (generation during training)")
        ax.set(xlabel="step", ylabel="fraction", ylim=(-0.05, 1.05))
        return None

    def throughput(ax: Any) -> Optional[str]:
        drawn = False
        for key, label in (("tokens_per_s", "generated tokens/s"), ("samples_per_s", "trained samples/s"),
                           ("train/tokens_per_s_per_gpu", "trainer tokens/s per GPU")):
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, ".-", label=label)
                drawn = True
        if not drawn:
            return "no throughput metrics"
        ax.set(xlabel="step", ylabel="per second", yscale="log")
        return None

    def mfu(ax: Any) -> Optional[str]:
        steps, values = series(rows, "train/mfu")
        if not steps:
            return "not reported (train/mfu is null: no known peak FLOP/s for this device, e.g. on CPU)"
        ax.plot(steps, values, ".-", label="train/mfu")
        ax.set(xlabel="step", ylabel="model FLOPs utilisation")
        return None

    def lengths(ax: Any) -> Optional[str]:
        drawn = False
        for name in ("trained", "dropped_stale", "dropped_filtered"):
            steps, values = series(rows, f"len_{name}_mean")
            if steps:
                count = sum(r.get(f"len_{name}_n") or 0 for r in rows)
                ax.plot(steps, values, "o-" if name != "trained" else ".-", label=f"{name} ({count} samples)")
                drawn = True
        if not drawn:
            return "no length metrics (len_trained_mean)"
        ax.set(xlabel="step", ylabel="mean response length (tokens)")
        return None

    def fleet(ax: Any) -> Optional[str]:
        steps, size = series(rows, "fleet_size")
        if not steps:
            return "no fleet metrics (fleet_size)"
        ax.step(steps, size, where="post", label="engines in the fleet")
        for key, label in (("engines_joined", "joined (total)"), ("engines_left", "left or lost (total)")):
            s_steps, values = series(rows, key)
            if s_steps:
                ax.plot(s_steps, values, ".-", label=label)
        ax.set(xlabel="step", ylabel="engines")
        return None

    draws = {"reward": reward, "eval": evaluation, "staleness": staleness, "stage-times": stages,
             "engine-busy": busy, "throughput": throughput, "mfu": mfu, "lengths": lengths, "fleet": fleet}
    return {name: _png(draw) for name, draw in draws.items()}


# ------------------------------------------------------------------ the page
TITLES = {"reward": "Reward", "eval": "Evaluation", "staleness": "Staleness histogram",
          "stage-times": "Stage times per step", "engine-busy": "Engine busy fraction and pipeline overlap",
          "throughput": "Throughput", "mfu": "MFU", "lengths": "Lengths of trained vs dropped samples",
          "fleet": "Rollout fleet",
          "config": "Config that ran"}
STYLE = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}h1{font-size:1.4em}"
         "h2{font-size:1.1em;border-bottom:1px solid #ccc}table{border-collapse:collapse}"
         "td,th{padding:2px 10px;text-align:left}pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto}"
         ".note{color:#777;font-style:italic}")


def summary(rows: list[dict]) -> list[tuple[str, str]]:
    def mean(key: str, part: slice = slice(None)) -> str:
        values = series(rows[part], key)[1]
        return f"{sum(values) / len(values):.4g}" if values else "—"

    tenth = max(1, len(rows) // 10)
    return [("steps", str(len(rows))), ("policy version at the end", str(rows[-1].get("version", "—"))),
            ("reward_mean, first / last 10% of steps", f"{mean('reward_mean', slice(0, tenth))} / "
                                                        f"{mean('reward_mean', slice(-tenth, None))}"),
            ("time_step (s), mean", mean("time_step")), ("tokens_per_s, mean", mean("tokens_per_s")),
            ("pipeline/overlap, mean", mean("pipeline/overlap")), ("staleness_mean, mean", mean("staleness_mean")),
            *fleet_summary(rows)]


def fleet_summary(rows: list[dict]) -> list[tuple[str, str]]:
    """The fleet's size over the run, and what joined, left and was re-issued (elastic fleet)."""
    size = series(rows, "fleet_size")[1]
    if not size:
        return []
    out = [("rollout fleet (engines): min / max / at the end", f"{min(size):g} / {max(size):g} / {size[-1]:g}")]
    last = rows[-1]
    if "engines_joined" in last:
        out.append(("engines joined / left or lost, requests re-issued",
                    f"{last['engines_joined']:g} / {last['engines_left']:g}, {last.get('requests_reissued', 0):g}"))
    return out


def build_report(run_dir: str) -> str:
    """The HTML page of the run in `run_dir` (metrics.jsonl, eval.jsonl, config.yaml)."""
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        raise ValueError(f"{run_dir}: no metrics.jsonl rows (is it a run directory?)")
    evals = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    config_path = os.path.join(run_dir, "config.yaml")
    config = open(config_path).read() if os.path.isfile(config_path) else "(no config.yaml in the run directory)"
    traces = sorted(f for f in os.listdir(run_dir) if f.startswith("trace") and f.endswith(".json"))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>run report: {html.escape(run_dir)}</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>Run report: {html.escape(run_dir)}</h1>",
             "<section id='summary'><h2>Summary</h2><table>"
             + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary(rows))
             + "</table>"
             + (f"<p>Timeline: {', '.join(html.escape(t) for t in traces)} (open in ui.perfetto.dev)</p>" if traces
                else "<p class='note'>no trace (logging.trace=false)</p>") + "</section>"]
    for name, (png, why) in figures(rows, evals).items():
        body = (f"<img alt='{TITLES[name]}' src='data:image/png;base64,{png}'>" if png
                else f"<p class='note'>{html.escape(why or '')}</p>")
        parts.append(f"<section id='{name}'><h2>{TITLES[name]}</h2>{body}</section>")
    parts.append(f"<section id='config'><h2>{TITLES['config']}</h2><pre>{html.escape(config)}</pre></section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run's logging.dir (metrics.jsonl, config.yaml, eval.jsonl)")
    p.add_argument("--out", default="", help="the HTML file (default: RUN_DIR/report.html)")
    args = p.parse_args(argv)
    try:
        page = build_report(args.run_dir)
    except (ValueError, OSError) as error:
        print(f"report: {error}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
