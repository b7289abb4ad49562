"""Delta weight sync through real engines (tools/weight_sync/delta_check.py): a one-process Megatron
trainer in fp32 with Adam, two local engine servers in bf16, WeightBridge with weight_sync.delta on.

After every push each engine's checksum of every tensor must equal the checksum of the trainer's own
HF tensors cast to bf16 (computed by the tool from the trainer, not from the bridge's kept copy);
every 10th push and after the last the values are compared bit for bit. The faults on engine 1: a
restart the bridge is told of (full push), a restart behind its back (the engine refuses the delta:
another base version), a request whose delta parts are lost (checksums missing at the final call)
and one with a bit flipped (checksum mismatch), in each transport's block (ipc, broadcast, disk: one
bridge each, 33 or 34 pushes). Each fault must be caught by its own counter, re-sync the engine with a
full push, and leave it bit-identical.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import json_rows, run_tool

# pushes 0-33 ipc, 34-67 broadcast, 68-100 disk (one bridge each: its first push is whole)
BLOCKS = {"ipc": range(0, 34), "broadcast": range(34, 68), "disk": range(68, 101)}
FAULTS = {"restart": [10, 55], "silent_restart": [20, 75], "drop": [15, 50, 90], "corrupt": [40, 85]}
ARGS = [a for kind, versions in FAULTS.items() for v in versions for a in (f"--{kind.replace('_', '-')}-at", str(v))]


@pytest.fixture(scope="module")
def hundred(tiny_models) -> tuple[list[dict], dict]:
    proc = run_tool(["tools/weight_sync/delta_check.py", "--model-path", tiny_models["llama"], "--pushes", "100",
                     "--anchor-every", "25", *[a for t in BLOCKS for a in ("--transport", t)], *ARGS], timeout=900)
    rows = json_rows(proc.stdout)
    return rows[:-1], rows[-1]


def test_a_hundred_pushes_leave_every_engine_bit_identical(hundred) -> None:
    rows, summary = hundred
    assert summary["num_problems"] == 0, json.dumps(summary["problems"])
    assert len(rows) == 101 and summary["values_compared"] == 11
    assert all(r["version"] in BLOCKS[r["transport"]] for r in rows)
    # each bridge's first push and every 25th after it go whole to every engine; the rest are deltas
    assert [r["version"] for r in rows if r["anchor"]] == [0, 25, 34, 59, 68, 93]
    quiet = [r for r in rows if not r["anchor"] and r["fault"] in ("", "drop", "corrupt")]
    assert len(quiet) == 101 - 6 - 4 and all(r["modes"].get("delta") == 2 for r in quiet)
    assert all(r["density"] is not None and 0 < r["density"] < 0.5 for r in rows if r["modes"].get("delta")), rows
    # a delta push carries less than a whole one (the bytes the same tensors weigh whole in bf16)
    assert all(r["bytes"] < r["bytes_full"] for r in rows if r["modes"] == {"delta": 2})


def test_each_fault_is_caught_counted_and_repaired(hundred) -> None:
    rows, summary = hundred
    by = {r["version"]: r for r in rows}
    for version in FAULTS["restart"]:  # the bridge was told: a full push to it, no error
        assert by[version]["modes"] == {"delta": 1, "full": 1} and by[version]["errors"] == {}, by[version]
    victims = set()
    for version in FAULTS["silent_restart"]:  # its version is 'default': the delta is refused, then a full re-sync
        r = by[version]
        assert r["delta_refused"] == 1 and r["checksum_failures"] == 0 and len(r["resynced"]) == 1, r
        assert f"delta refused: it applies to weight_version '{version - 1}', this engine serves 'default'" in \
            next(iter(r["errors"].values()))
        victims.update(r["resynced"])
    for version in FAULTS["drop"]:
        r = by[version]
        assert r["checksum_failures"] == 1 and set(r["resynced"]) == victims, r
        assert "the trainer sent" in next(iter(r["errors"].values()))
    for version in FAULTS["corrupt"]:
        r = by[version]
        assert r["checksum_failures"] == 1 and set(r["resynced"]) == victims, r
        assert "checksum mismatch on 1 tensor(s)" in next(iter(r["errors"].values()))
    assert summary["checksum_failures"] == 5 and summary["delta_refused"] == 2 and summary["resyncs"] == 7
    # the push after each fault is a plain delta again: the re-synced engine is back on the chain
    for version in (v + 1 for kind in FAULTS.values() for v in kind):
        assert by[version]["modes"] == {"delta": 2} and by[version]["errors"] == {}, by[version]
