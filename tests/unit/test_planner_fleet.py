"""The planner's fleet model (megatron_flash/planner/fleet.py, `tools/plan_resources.py --fleet-sizes
--add-nodes`): step time vs rollout fleet size and how many rollout nodes to add, against hand computations.

The hand model of most tests: every response is 100 tokens, a decode step costs 10 ms whatever the batch, so a
sample takes 1 s on an engine of 16 slots; B = 64 samples (8 groups of 8); training 1 s, the push 0.5 s; eager
admission with α = 4, so the engines always have admitted work while the rollout is behind. A fleet of E
engines finishes 16·E samples a second: a batch every 64 / (16·E) s — 4, 2, 1, 0.5 s with 1, 2, 4, 8 engines
(8 engines: 128 slots finish two batches a second). The trainer needs 1 + 0.5 = 1.5 s a step, so the step is
4 and 2 s with 1 and 2 engines (rollout-bound) and 1.5 s from 3 engines on (48 samples a second, more than
the 64 / 1.5 = 42.7 the trainer takes).
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_flash import planner

ROOT = Path(__file__).resolve().parents[2]
SIM = dict(alpha=4, num_steps=30, admission="eager")


def _costs(*, train=1.0, sync=0.5):
    return planner.Costs(decode_step=lambda k: 0.01, engine_cap=16, prefill_s=0.0,
                         train_s=lambda g, tokens: train, sync_s=sync)


def _work():
    return planner.Workload(batch_size=64, group_size=8, lengths=lambda rng: 100)


def _point(costs, engines_per_node=1, push_s_per_engine=0.0):
    return lambda engines: planner.fleet_point(work=_work(), costs=costs, engines=engines, train_gpus=1,
                                               engines_per_node=engines_per_node,
                                               push_s_per_engine=push_s_per_engine, **SIM)


@pytest.mark.parametrize("engines,nodes,rollout,step,bound", [
    (1, 1, 4.0, 4.0, "rollout"), (2, 1, 2.0, 2.0, "rollout"), (4, 1, 1.0, 1.5, "train"), (8, 2, 0.5, 1.5, "train")])
def test_rollout_time_halves_with_twice_the_engines_until_training_dominates(engines, nodes, rollout, step, bound):
    p = _point(_costs(), engines_per_node=4)(engines)
    assert (p.engines, p.nodes, p.bound) == (engines, nodes, bound)
    assert p.rollout_s == pytest.approx(rollout) and p.step_s == pytest.approx(step)
    assert p.train_s == pytest.approx(1.0) and p.push_s == pytest.approx(0.5)
    assert p.samples_per_s == pytest.approx(64 / step) and p.wait_s == pytest.approx(step - 1.5)


def test_train_time_is_the_step_the_simulation_charges_for_the_batchs_tokens():
    # train_s = tokens / 64000 s: B · (prompt 512 + response 100) = 64 · 612 = 39,168 tokens → 0.612 s on 1 GPU.
    # With 8 engines the rollout (0.5 s a batch) is faster: the step is the trainer's 0.612 + 0.5 push.
    c = _costs()
    c.train_s = lambda g, tokens: tokens / 64000 / g
    p = _point(c)(8)
    assert p.train_s == pytest.approx(0.612) and p.step_s == pytest.approx(1.112) and p.bound == "train"


def test_add_nodes_stops_where_training_becomes_the_bottleneck():
    # One engine a node, one now: 4 s, 2 s, then 1.5 s (the trainer's floor) with 1, 2, 3 engines. Adding 1 node
    # leaves a fleet 25 % faster (1.5 vs 2 s); after 2 nothing is faster than 1.5 s: the answer is 2 nodes,
    # 4 / 1.5 = 2.67×, final at once (1.5 · 0.95 ≤ 1.5), so the scan stops at 3 engines.
    a = planner.add_nodes(_point(_costs()), current_engines=1, engines_per_node=1, threshold=0.05, max_add=8,
                          join_s=3.0)
    assert [p.engines for p in a.scanned] == [1, 2, 3]
    assert [p.step_s for p in a.scanned] == pytest.approx([4.0, 2.0, 1.5])
    assert (a.add_nodes, a.engines, a.converged) == (2, 3, True)
    assert a.step_s == pytest.approx(1.5) and a.speedup == pytest.approx(4 / 1.5) and a.floor_s == pytest.approx(1.5)
    assert a.join_push_s == 3.0 and a.fastest == 2
    # Already train-bound with 4 engines: add nothing, one fleet simulated.
    b = planner.add_nodes(_point(_costs()), current_engines=4, engines_per_node=2, threshold=0.05, max_add=8)
    assert (b.add_nodes, b.engines, len(b.scanned), b.converged) == (0, 4, 1, True)
    assert b.speedup == pytest.approx(1.0)


def test_a_push_that_grows_with_the_engines_moves_the_answer():
    # No fixed push, 0.25 s per engine: the trainer's floor is 1 + 0.25·E = 1.25, 1.5, 1.75, 2.0 s with 1-4
    # engines. Steps: 4 (rollout), 2 (rollout: 2 > 1.5), 1.75 (floor: the fleet makes 48 samples a second,
    # the trainer takes 64 / 1.75 = 36.6), 2.0 (floor): 3 engines are the fastest, a 4th is slower.
    point = _point(_costs(sync=0.0), push_s_per_engine=0.25)
    assert [point(e).step_s for e in (1, 2, 3, 4)] == pytest.approx([4.0, 2.0, 1.75, 2.0])
    assert point(4).push_s == pytest.approx(1.0) and point(4).bound == "train"
    a = planner.add_nodes(point, current_engines=1, engines_per_node=1, threshold=0.05, max_add=8)
    assert (a.add_nodes, a.engines, a.converged, len(a.scanned)) == (2, 3, True, 3)
    assert a.step_s == pytest.approx(1.75) and a.speedup == pytest.approx(4 / 1.75)


def test_add_nodes_when_the_rollout_client_holds_the_rollout_back():
    # The client hands out a request every 50 ms: 20 a second whatever the fleet. One engine (16 slots, 1 s a
    # sample) finishes 16 a second: 4 s a batch; from 2 engines on the client's 64 · 0.05 = 3.2 s a batch. The
    # trainer's floor (1 + 0.25 = 1.25 s) is never reached: the answer (1 node) holds over the nodes scanned only.
    c = _costs(sync=0.25)
    c.client_per_request_s = 0.05
    a = planner.add_nodes(_point(c), current_engines=1, engines_per_node=1, threshold=0.05, max_add=3)
    assert [p.step_s for p in a.scanned] == pytest.approx([4.0, 3.2, 3.2, 3.2])
    assert [p.bound for p in a.scanned] == ["rollout"] * 4
    assert (a.add_nodes, a.converged) == (1, False) and a.speedup == pytest.approx(1.25)


def test_settle_picks_the_smallest_fleet_no_larger_one_beats_by_more_than_the_threshold():
    # 5 %: 10 → no (4.9 < 9.5); 6 → no (4.9 < 5.7); 5.8 → no (4.9 < 5.51); 5.0 → yes (4.9 ≥ 4.75).
    assert planner.settle([10, 6, 5.8, 5.0, 4.9], floor=4.0, threshold=0.05) == (3, False)  # 4.75 > 4.0
    assert planner.settle([10, 6, 5.8, 5.0, 4.9], floor=4.8, threshold=0.05) == (3, True)  # 4.75 ≤ 4.8
    # not monotone: 2.0 → later 2.05 and 1.95 are both ≥ 1.9
    assert planner.settle([4.0, 2.0, 2.05, 1.95], floor=1.0, threshold=0.05) == (1, False)
    assert planner.settle([3.0], floor=3.0, threshold=0.05) == (0, True)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="threshold"):
            planner.settle([1.0], floor=1.0, threshold=bad)


def test_join_push_is_one_whole_push():
    # 1e9 bf16 parameters = 2 GB over a 50 GB/s link: 0.04 s, plus 1 s of sync overhead; deltas do not apply.
    model, gpu = planner.ModelSpec(num_params=1e9), planner.GPUSpec.from_name("H100")
    assert planner.join_push_s(model, gpu, 1.0) == pytest.approx(1.04)


def _tool():
    spec = importlib.util.spec_from_file_location("plan_resources", ROOT / "tools/plan_resources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["--total-gpus", "16", "--batch-size", "64", "--len-mean", "500", "--max-len", "2048", "--steps", "9"]


@pytest.mark.parametrize("argv,flag", [
    (["--fleet-sizes", "0"], "--fleet-sizes"), (["--fleet-sizes", "1,x"], "--fleet-sizes"),
    (["--fleet-sizes", "1.5"], "--fleet-sizes"), (["--fleet-sizes", "2,"], "--fleet-sizes"),
    (["--fleet-nodes", "-1"], "--fleet-nodes"), (["--fleet-sizes", "2", "--fleet-nodes", "1"], "--fleet-nodes"),
    (["--add-nodes", "--add-nodes-threshold", "0"], "--add-nodes-threshold"),
    (["--add-nodes", "--max-add-nodes", "0"], "--max-add-nodes"), (["--engines", "-2"], "--engines"),
    (["--engines-per-node", "-1"], "--engines-per-node")])
def test_cli_refuses_bad_fleet_flags_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _tool().main(SMALL + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "error:" in err


def test_cli_refuses_bad_fleet_sizes_from_yaml(tmp_path, capsys):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text("fleet_sizes: [2, 4]\n")
    assert _tool().parse(["--config", str(cfg)]).fleet == [2, 4]
    cfg.write_text("fleet_sizes: [0, 4]\n")
    with pytest.raises(SystemExit) as e:
        _tool().parse(["--config", str(cfg)])
    assert e.value.code == 2 and "--fleet-sizes" in capsys.readouterr().err


def test_cli_fleet_table_and_add_nodes_json(capsys):
    tool = _tool()
    assert tool.main(SMALL) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not {"fleet", "add_nodes", "fleet_train_gpus"} & set(plain)  # nothing new unless asked
    assert tool.main(SMALL + ["--fleet-nodes", "1,2", "--engines-per-node", "4", "--add-nodes", "--max-add-nodes",
                              "2"]) == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert {k: v for k, v in last.items() if k in plain} == plain  # the existing fields unchanged
    assert last["fleet_train_gpus"] == plain["recommended"]["train_gpus"]
    assert [(r["engines"], r["nodes"]) for r in last["fleet"]] == [(4, 1), (8, 2)]
    for r in last["fleet"]:
        assert r["step_s"] >= r["train_s"] + r["push_s"] - 1e-3 and r["bound"] in ("rollout", "train")
        assert r["samples_per_s"] == pytest.approx(64 / r["step_s"], rel=1e-3)
    a = last["add_nodes"]
    current = plain["recommended"]["rollout_gpus"]  # --engine-tp 1: an engine a GPU
    assert a["current_engines"] == current and a["engines_per_node"] == 4
    assert [r["engines"] for r in a["scanned"]] == [current + 4 * k for k in range(len(a["scanned"]))]
    assert 0 <= a["add_nodes"] < len(a["scanned"]) <= 3 and a["engines"] == current + 4 * a["add_nodes"]
    assert a["nodes"] == math.ceil(a["engines"] / 4) and a["step_s"] == a["scanned"][a["add_nodes"]]["step_s"]
    assert "fleet: " in out and "→ add" in out
