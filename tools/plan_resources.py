"""How many GPUs for rollout? Predict sync vs async step time over train/rollout splits.

    python tools/plan_resources.py --params 7e9 --layers 28 --hidden 3584 --kv-heads 4 --gpu H100 \\
        --total-gpus 40 --batch-size 512 --group-size 8 --lengths lognormal --len-mean 4000 --len-sigma 1.0
    python tools/plan_resources.py --config plan.yaml --png runs/plan.png
    python tools/plan_resources.py ... --measured runs/x/metrics.jsonl --measured-train-gpus 8

YAML keys are the flag names with '_' for '-'. `--measured` (a previous run's metrics.jsonl, steady-state
median of time_train, time_sync, time_rollout_wait from an α = 0 run) overrides the model: train and
sync seconds are taken as measured (scaled by --measured-train-gpus / train GPUs) and the decode model
is scaled so that the simulated synchronous generation time equals the measured one.
Model and simulator: megatron_flash/planner/ (models, simulation, admission, engine, lengths). Per split it
prints staleness per sample (V − start version) and per token (V − the version that sampled it), the mean
admission lookahead L and the trainer's wait for rollout per step (--admission: the product's rule).
Last line: a JSON object.

Fleet size (a running job whose rollout fleet grows: engines from other allocations join it; the train GPUs
stay). `--fleet-sizes 1,2,4,8` (engines) or `--fleet-nodes 1,2,4` (nodes of --engines-per-node engines)
prints per fleet size the predicted rollout, train, push and step seconds, samples/s and the bottleneck;
`--add-nodes` answers how many rollout nodes to add to the current fleet (--engines, default the recommended
split's) before step time stops improving by more than --add-nodes-threshold %. The train GPUs are
--train-gpus (default the recommended split's). JSON: `fleet` and `add_nodes`. Model: megatron_flash/planner/fleet.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_flash import planner  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default="", help="YAML of flag values (flags given explicitly win)")
    a("--params", type=float, default=7e9)
    a("--layers", type=int, default=28)
    a("--hidden", type=int, default=3584)
    a("--kv-heads", type=int, default=4)
    a("--head-dim", type=int, default=128)
    a("--gpu", default="H100", help=f"{sorted(planner.GPU_TABLE)} or a custom name with the four numbers")
    a("--gpu-flops", type=float, default=0.0)
    a("--gpu-hbm-gbs", type=float, default=0.0)
    a("--gpu-mem-gb", type=float, default=0.0)
    a("--gpu-link-gbs", type=float, default=0.0)
    a("--total-gpus", type=int, default=40)
    a("--engine-tp", type=int, default=1)
    a("--train-unit", type=int, default=8, help="train GPUs come in multiples of TP×PP (and DP≥1)")
    a("--batch-size", type=int, default=512)
    a("--group-size", type=int, default=8)
    a("--prompt-len", type=int, default=512)
    a("--lengths", default="lognormal", choices=["lognormal", "inv_k", "constant", "file"])
    a("--len-mean", type=float, default=4000)
    a("--len-sigma", type=float, default=1.0)
    a("--max-len", type=int, default=16384)
    a("--lengths-file", default="", help="jsonl with response lengths (metrics / groups dumps)")
    a("--num-turns", type=int, default=1, help="agentic: generation segments per sample")
    a("--env-latency-mean", type=float, default=0.0, help="seconds; lognormal with --env-latency-sigma")
    a("--env-latency-sigma", type=float, default=1.0)
    a("--env-mode", default="async", choices=["async", "batch"])
    a("--alpha", type=int, default=2)
    a("--admission", default=planner.DEFAULT_ADMISSION, choices=list(planner.ADMISSIONS),
      help="async_rl.admission: tokens (a fraction of a batch ahead), adaptive (whole batches, 1 up to α while the "
           "trainer waits) or eager (α batches ahead)")
    a("--min-lookahead", type=float, default=1.0, help="async_rl.min_lookahead (admission tokens only)")
    a("--scheduling", default="queue", choices=["queue", "batch"])
    a("--no-prompt-replication", action="store_true")
    a("--extra-groups", type=int, default=0, help="redundant prompts (rollout.extra_prompts)")
    a("--replication-chunk", type=int, default=0, help="rollout.replication_chunk (0: 1 with replication)")
    a("--keep-prob", type=float, default=1.0, help="dynamic filter: fraction of finished groups kept")
    a("--max-inflight-groups", type=int, default=0, help="agentic: env instances / group size (0 = no cap)")
    a("--decode-points", default="", help="measured decode-step seconds 'k:s,k:s,...' (replaces the model; "
                                            "benchmarks/engine_step_cost.py measures them)")
    a("--per-request-s", type=float, default=0.0,
      help="seconds each request adds to its own engine time (processor-shared: holds its slot)")
    a("--request-engine-s", type=float, default=0.0,
      help="engine-exclusive seconds per request (adds up over concurrent requests; local engine: HTTP, "
           "admission, prefill under one GIL; benchmarks/engine_step_cost.py --loop-k measures it)")
    a("--client-per-request-s", type=float, default=0.0, help="rollout client seconds per request (serial)")
    a("--turn-tokens", type=int, default=0, help="agentic: tokens each env turn appends (observation + template)")
    a("--prefill-token-engine-s", type=float, default=0.0,
      help="engine-exclusive seconds per prefilled token (benchmarks/engine_step_cost.py --loop-prompt-len 2,100)")
    a("--no-prefix-cache", action="store_true",
      help="engines re-prefill the whole conversation each turn (the local engine server; SGLang caches prefixes)")
    a("--mfu", type=float, default=0.4)
    a("--max-running", type=int, default=256)
    a("--sync-overhead-s", type=float, default=1.0)
    a("--delta-density", type=float, default=0.0,
      help="weight_sync.delta: share of engine-dtype values that change per push (docs/benchmarks.md: 0.006-0.02 "
           "at lr 1e-6-1e-5); 0 = whole pushes")
    a("--delta-anchor-every", type=int, default=20, help="weight_sync.delta_anchor_every")
    a("--measured", default="", help="metrics.jsonl of an α = 0 run whose times override the model")
    a("--measured-train-gpus", type=int, default=0)
    a("--steps", type=int, default=30)
    a("--seed", type=int, default=0)
    a("--png", default="", help="write speedup vs split and vs α here")
    a("--fleet-sizes", default="", help="rollout fleet sizes in engines, e.g. 1,2,4,8: step time vs fleet")
    a("--fleet-nodes", default="", help="rollout fleet sizes in nodes (× --engines-per-node), e.g. 1,2,4")
    a("--engines-per-node", type=int, default=0, help="engines a rollout node holds (0: 8 GPUs / --engine-tp)")
    a("--engines", type=int, default=0, help="the current rollout fleet in engines (0: the recommended split's)")
    a("--train-gpus", type=int, default=0, help="train GPUs of the fleet table (0: the recommended split's)")
    a("--add-nodes", action="store_true", help="how many rollout nodes to add to --engines before step time stops "
                                                 "improving by more than --add-nodes-threshold")
    a("--add-nodes-threshold", type=float, default=5.0,
      help="percent: the answer is the fewest nodes after which no larger fleet is faster by more than this")
    a("--max-add-nodes", type=int, default=16, help="scan at most this many extra nodes")
    a("--push-s-per-engine", type=float, default=0.0,
      help="seconds each engine adds to every push (0: broadcast/disk reach all engines in one push)")
    args = p.parse_args(argv)
    if args.config:
        import yaml
        with open(args.config) as f:
            cfg = yaml.safe_load(f) or {}
        given = {x.split("=")[0].lstrip("-").replace("-", "_") for x in (argv or sys.argv[1:]) if x.startswith("--")}
        for k, v in cfg.items():
            k = k.replace("-", "_")
            if not hasattr(args, k):
                raise ValueError(f"{args.config}: unknown key {k!r}")
            if k not in given:
                setattr(args, k, v)
    check_fleet_args(p, args)
    return args


def _counts(p: argparse.ArgumentParser, flag: str, value) -> list[int]:
    """'1,2,4' (or a YAML list) → [1, 2, 4]; anything but positive integers is refused naming the flag (exit 2)."""
    items = value if isinstance(value, list) else str(value).split(",")
    if not all(isinstance(x, (int, str)) and not isinstance(x, bool) and str(x).strip().isdigit()
               and int(str(x).strip()) >= 1 for x in items) or not items:
        p.error(f"{flag} {value!r}: expected positive integers separated by commas, e.g. 1,2,4,8")
    return [int(str(x).strip()) for x in items]


def check_fleet_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fleet_sizes and args.fleet_nodes:
        p.error("--fleet-sizes and --fleet-nodes: give one (engines or nodes)")
    for flag in ("engines_per_node", "engines", "train_gpus"):
        if not isinstance(getattr(args, flag), int) or getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: expected an integer ≥ 0 (0: the default)")
    if not isinstance(args.max_add_nodes, int) or args.max_add_nodes < 1:
        p.error(f"--max-add-nodes {args.max_add_nodes!r}: expected an integer ≥ 1")
    if not 0 < args.add_nodes_threshold < 100:
        p.error(f"--add-nodes-threshold {args.add_nodes_threshold!r}: expected a percentage in (0, 100)")
    if args.push_s_per_engine < 0:
        p.error(f"--push-s-per-engine {args.push_s_per_engine!r}: expected seconds ≥ 0")
    args.engines_per_node = args.engines_per_node or max(1, 8 // max(1, args.engine_tp))
    args.fleet = ([n * args.engines_per_node for n in _counts(p, "--fleet-nodes", args.fleet_nodes)]
                  if args.fleet_nodes else _counts(p, "--fleet-sizes", args.fleet_sizes) if args.fleet_sizes else [])


def measured_times(path: str, skip: int = 3) -> dict[str, float]:
    rows = [json.loads(x) for x in open(path) if x.strip()]
    rows = rows[skip:] or rows
    keys = ("time_train", "time_sync", "tokens_per_s", "time_rollout_wait", "response_len_mean", "samples_per_s",
            "time_step")
    return {k: statistics.median(float(r[k]) for r in rows if k in r) for k in keys if any(k in r for r in rows)}


def model_gpu(args: argparse.Namespace) -> tuple[planner.ModelSpec, planner.GPUSpec]:
    model = planner.ModelSpec(num_params=args.params, num_layers=args.layers, hidden_size=args.hidden,
                              num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    gpu = planner.GPUSpec.from_name(args.gpu, flops=args.gpu_flops, hbm_gbs=args.gpu_hbm_gbs,
                                    mem_gb=args.gpu_mem_gb, link_gbs=args.gpu_link_gbs)
    return model, gpu


def build(args: argparse.Namespace):
    model, gpu = model_gpu(args)
    if args.lengths == "lognormal":
        lengths = planner.lognormal_lengths(args.len_mean, args.len_sigma, args.max_len)
    elif args.lengths == "inv_k":
        lengths = planner.inv_k_lengths(args.max_len)
    elif args.lengths == "constant":
        lengths = lambda rng, m=int(args.len_mean): m  # noqa: E731
    else:
        lengths = planner.empirical_lengths(planner.read_lengths_file(args.lengths_file))
    env = (planner.lognormal_lengths(args.env_latency_mean, args.env_latency_sigma, 10**9)
           if args.env_latency_mean > 0 else (lambda rng: 0.0))
    env_s = (lambda rng: float(env(rng))) if args.env_latency_mean >= 1 else (
        lambda rng: args.env_latency_mean * rng.lognormvariate(-args.env_latency_sigma ** 2 / 2, args.env_latency_sigma)
        if args.env_latency_mean > 0 else 0.0)
    work = planner.Workload(batch_size=args.batch_size, group_size=args.group_size, prompt_len=args.prompt_len,
                            lengths=lengths, num_turns=args.num_turns, env_latency=env_s, keep_prob=args.keep_prob,
                            max_inflight_groups=args.max_inflight_groups, turn_tokens=args.turn_tokens)
    mean_len = planner._mean_len(work)
    costs = planner.Costs.from_models(model=model, gpu=gpu, engine_tp=args.engine_tp,
                                      mean_ctx=args.prompt_len + mean_len / 2, max_ctx=args.prompt_len + args.max_len,
                                      mfu=args.mfu, max_running=args.max_running,
                                      sync_overhead_s=args.sync_overhead_s, prompt_len=args.prompt_len,
                                      delta_density=args.delta_density, anchor_every=args.delta_anchor_every)
    if args.decode_points:
        try:
            points = [(int(k), float(v)) for k, v in (x.split(":") for x in args.decode_points.split(","))]
        except ValueError:
            raise ValueError(f"--decode-points {args.decode_points!r}: expected 'k:seconds,k:seconds,...'") from None
        costs.decode_step = planner.measured_decode(points)
    costs.per_request_s, costs.client_per_request_s = args.per_request_s, args.client_per_request_s
    costs.request_engine_s = args.request_engine_s
    costs.prefill_token_engine_s, costs.prefix_cache = args.prefill_token_engine_s, not args.no_prefix_cache
    return work, costs


def apply_measured(args, work, costs):
    """Measured α = 0 times → train/sync fixed, decode scaled to reproduce the measured generation time."""
    m = measured_times(args.measured)
    g0 = args.measured_train_gpus or args.total_gpus
    if "time_train" in m:
        costs.train_s = lambda g, tokens, t=m["time_train"]: t * g0 / g
    if "time_sync" in m:
        costs.sync_s = m["time_sync"]
    if "time_rollout_wait" in m:
        engines = max(1, (args.measured_rollout_gpus or args.total_gpus) // args.engine_tp)
        sim = planner.simulate(work=work, costs=costs, num_engines=engines, train_gpus=g0, alpha=0,
                               num_steps=args.steps, scheduling=args.scheduling, seed=args.seed)
        gen = sim.sec_per_step - costs.train_s(g0, 0) - costs.sync_s
        scale = m["time_rollout_wait"] / max(gen, 1e-9)
        base = costs.decode_step
        costs.decode_step = lambda k, b=base, s=scale: s * b(k)
        costs.prefill_s *= scale
    return m


def sim_options(args) -> dict:
    """simulate's keywords from the flags, besides the work, the costs, the split and α."""
    return dict(num_steps=args.steps, scheduling=args.scheduling, prompt_replication=not args.no_prompt_replication,
                extra_groups=args.extra_groups, replication_chunk=args.replication_chunk, env_mode=args.env_mode,
                admission=args.admission, min_lookahead=args.min_lookahead, seed=args.seed)


def evaluate(args, work, costs) -> dict:
    common = dict(work=work, costs=costs, **sim_options(args))
    G, tp, unit = args.total_gpus, args.engine_tp, args.train_unit
    base = planner.simulate(num_engines=max(1, G // tp), train_gpus=G, alpha=0, colocated=True, **common)
    rows = []
    for train in range(unit, G, unit):
        engines = (G - train) // tp
        if engines < 1:
            continue
        r = planner.simulate(num_engines=engines, train_gpus=train, alpha=args.alpha, **common)
        rows.append({"train_gpus": train, "rollout_gpus": engines * tp, "sec_per_step": r.sec_per_step,
                     "samples_per_s": r.samples_per_s, "train_idle": r.train_idle_frac,
                     "rollout_idle": r.rollout_idle_frac, "staleness": r.staleness_mean,
                     "token_staleness": r.token_staleness_mean, "lookahead": r.lookahead_mean,
                     "train_wait_s": r.train_wait_s, "speedup": base.sec_per_step / r.sec_per_step})
    if not rows:
        raise ValueError(f"total_gpus={G} leaves no split with train_unit={unit} and engine_tp={tp}")
    best = max(rows, key=lambda x: x["speedup"])
    alphas = {}
    for a in (0, 1, 2, 4, 8):
        r = planner.simulate(num_engines=best["rollout_gpus"] // tp, train_gpus=best["train_gpus"], alpha=a, **common)
        alphas[a] = base.sec_per_step / r.sec_per_step
    return {"baseline": {"sec_per_step": base.sec_per_step, "samples_per_s": base.samples_per_s,
                         "idle": base.train_idle_frac}, "rows": rows, "best": best, "speedup_vs_alpha": alphas}


def evaluate_fleet(args, work, costs, out) -> dict:
    """--fleet-sizes / --fleet-nodes and --add-nodes on the planner's fleet model (planner/fleet.py)."""
    train = args.train_gpus or out["best"]["train_gpus"]
    current = args.engines or max(1, out["best"]["rollout_gpus"] // args.engine_tp)
    cache: dict[int, planner.FleetPoint] = {}

    def point(engines: int) -> planner.FleetPoint:
        if engines not in cache:
            cache[engines] = planner.fleet_point(work=work, costs=costs, engines=engines, train_gpus=train,
                                                 engines_per_node=args.engines_per_node, alpha=args.alpha,
                                                 push_s_per_engine=args.push_s_per_engine, **sim_options(args))
        return cache[engines]

    res: dict = {"train_gpus": train}
    if args.fleet:
        res["fleet"] = [point(e) for e in args.fleet]
    if args.add_nodes:
        model, gpu = model_gpu(args)
        res["add_nodes"] = planner.add_nodes(point, current_engines=current, engines_per_node=args.engines_per_node,
                                             threshold=args.add_nodes_threshold / 100, max_add=args.max_add_nodes,
                                             join_s=planner.join_push_s(model, gpu, args.sync_overhead_s))
    return res


def fleet_row(x: planner.FleetPoint) -> dict:
    return {"engines": x.engines, "nodes": x.nodes, "rollout_s": round(x.rollout_s, 3), "train_s": round(x.train_s, 3),
            "push_s": round(x.push_s, 3), "step_s": round(x.step_s, 3), "samples_per_s": round(x.samples_per_s, 3),
            "wait_s": round(x.wait_s, 3), "bound": x.bound}


def print_fleet(args, res: dict) -> dict:
    """Prints the fleet table and the add-nodes answer; their JSON fields."""
    head = (f"{'engines':>7} {'nodes':>5} {'rollout s':>9} {'train s':>8} {'push s':>7} {'step s':>8} "
            f"{'samples/s':>9} {'wait s':>7} {'bound':>7}")

    def row(x: planner.FleetPoint, lead: str = "") -> str:
        return (f"{lead}{x.engines:>7} {x.nodes:>5} {x.rollout_s:>9.2f} {x.train_s:>8.2f} {x.push_s:>7.2f} "
                f"{x.step_s:>8.2f} {x.samples_per_s:>9.2f} {x.wait_s:>7.2f} {x.bound:>7}")

    push = ("the same for any fleet" if not args.push_s_per_engine
            else f"+ {args.push_s_per_engine:g} s per engine")
    print(f"fleet: {res['train_gpus']} train GPUs, engines of {args.engine_tp} GPU(s), {args.engines_per_node} a node; "
          f"α = {args.alpha}, {args.admission} admission; weight push {push}")
    js: dict = {"fleet_train_gpus": res["train_gpus"]}
    if "fleet" in res:
        print(head)
        for x in res["fleet"]:
            print(row(x))
        js["fleet"] = [fleet_row(x) for x in res["fleet"]]
    if "add_nodes" in res:
        a: planner.AddNodes = res["add_nodes"]
        pct = f"{args.add_nodes_threshold:g} %"
        print(f"add nodes to {a.current_engines} engines ({a.scanned[0].nodes} node(s)) "
              f"until a larger fleet buys ≤ {pct}:")
        print(f"{'+nodes':>6} " + head)
        for k, x in enumerate(a.scanned):
            print(row(x, f"{'+' + str(k):>6} "))
        what = f"add {a.add_nodes} node(s) ({a.engines} engines)" if a.add_nodes else "add no nodes"
        print(f"→ {what}: {a.step_s:.2f} s/step vs {a.base_step_s:.2f} now, {a.speedup:.2f}×; " + (
            f"no larger fleet is more than {pct} faster (the trainer's floor: {a.floor_s:.2f} s/step)" if a.converged
            else f"within the +{len(a.scanned) - 1} node(s) scanned (--max-add-nodes); still above the trainer's "
                 f"floor {a.floor_s:.2f} s/step: more engines do not lift what holds the rollout (client, "
                 "stragglers due, admission)"))
        f = a.fastest
        print(f"  fastest fleet scanned: +{f} node(s), {a.scanned[f].step_s:.2f} s/step, "
              f"{a.base_step_s / a.scanned[f].step_s:.2f}×")
        if a.add_nodes:
            print(f"  joining engines get one whole push first (rollout/fleet.py): ≈ {a.join_push_s:.2f} s once, "
                  f"on the step they join; the pushes after that cost the same as now")
        js["add_nodes"] = {"current_engines": a.current_engines, "engines_per_node": a.engines_per_node,
                           "threshold_pct": args.add_nodes_threshold, "add_nodes": a.add_nodes, "engines": a.engines,
                           "nodes": a.scanned[a.add_nodes].nodes, "step_s": round(a.step_s, 3),
                           "base_step_s": round(a.base_step_s, 3), "speedup": round(a.speedup, 3),
                           "floor_s": round(a.floor_s, 3), "converged": a.converged,
                           "join_push_s": round(a.join_push_s, 3),
                           "fastest_scanned": {"add_nodes": f, "step_s": round(a.scanned[f].step_s, 3)},
                           "scanned": [fleet_row(x) for x in a.scanned]}
    return js


def plot(path: str, out: dict, alpha: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot([r["rollout_gpus"] for r in out["rows"]], [r["speedup"] for r in out["rows"]], "o-")
    a1.set_xlabel("rollout GPUs (rest train)")
    a1.set_ylabel("speedup vs sync colocated")
    a1.set_title(f"α = {alpha}")
    a1.axhline(1.0, color="gray", lw=0.5)
    xs = sorted(out["speedup_vs_alpha"])
    a2.plot(xs, [out["speedup_vs_alpha"][x] for x in xs], "o-")
    a2.set_xlabel("α")
    a2.set_title(f"{out['best']['train_gpus']} train / {out['best']['rollout_gpus']} rollout")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.measured_rollout_gpus = getattr(args, "measured_rollout_gpus", 0)
    work, costs = build(args)
    measured = apply_measured(args, work, costs) if args.measured else {}
    out = evaluate(args, work, costs)
    print(f"baseline sync colocated on {args.total_gpus} GPUs: {out['baseline']['sec_per_step']:.2f} s/step, "
          f"engine cap {costs.engine_cap} seqs, sync {costs.sync_s:.2f} s")
    print(f"{'train':>5} {'rollout':>7} {'s/step':>8} {'samples/s':>9} {'train idle':>10} {'rollout idle':>12} "
          f"{'staleness':>9} {'token st.':>9} {'L':>4} {'wait s':>6} {'speedup':>7}")
    for r in out["rows"]:
        print(f"{r['train_gpus']:>5} {r['rollout_gpus']:>7} {r['sec_per_step']:>8.2f} {r['samples_per_s']:>9.2f} "
              f"{r['train_idle']:>10.2f} {r['rollout_idle']:>12.2f} {r['staleness']:>9.2f} "
              f"{r['token_staleness']:>9.2f} {r['lookahead']:>4.1f} {r['train_wait_s']:>6.2f} {r['speedup']:>7.2f}")
    b = out["best"]
    print(f"recommended: {b['train_gpus']} train / {b['rollout_gpus']} rollout GPUs, {b['speedup']:.2f}× "
          f"(α = {args.alpha}, {args.admission} admission); speedup vs α: " +
          ", ".join(f"{a}: {s:.2f}" for a, s in out["speedup_vs_alpha"].items()))
    if args.png:
        plot(args.png, out, args.alpha)
    fleet = print_fleet(args, evaluate_fleet(args, work, costs, out)) if args.fleet or args.add_nodes else {}
    print(json.dumps({"recommended": {"train_gpus": b["train_gpus"], "rollout_gpus": b["rollout_gpus"]},
                      "speedup": round(b["speedup"], 3), "sec_per_step": round(b["sec_per_step"], 3),
                      "staleness": round(b["staleness"], 3), "token_staleness": round(b["token_staleness"], 3),
                      "lookahead": round(b["lookahead"], 2), "train_wait_s": round(b["train_wait_s"], 3),
                      "admission": args.admission,
                      "baseline_sec_per_step": round(out["baseline"]["sec_per_step"], 3),
                      "speedup_vs_alpha": {str(k): round(v, 3) for k, v in out["speedup_vs_alpha"].items()},
                      "measured": measured, "png": args.png or None, **fleet}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
