"""tools/report.py on a run directory written here (the e2e α = 2 run builds one from a real run too):
every section by id and title, one embedded PNG each where the data exists, a note where it does not
(MFU null on CPU: "not reported"; no eval.jsonl), the config verbatim; the stage times add up to the
step; a directory without metrics fails with exit 2."""

from __future__ import annotations

import base64
import json
import re

import pytest
from tests.conftest import run_tool
from tools import report

TITLES = ("Reward", "Evaluation", "Staleness histogram", "Stage times per step",
          "Engine busy fraction and pipeline overlap", "Throughput", "MFU", "Lengths of trained vs dropped samples",
          "Rollout fleet", "Config that ran")


def write_run(path, *, mfu=None, evals=True) -> None:
    path.mkdir()
    rows = [{"step": s, "version": s + 1, "reward_mean": 0.1 * s, "staleness_mean": 0.5, "time_rollout_wait": 0.5,
             "time_train": 1.0, "time_sync": 0.4, "time_probe": 0.1, "time_step": 2.0, "engine_idle_frac": 0.25,
             "pipeline/overlap": 0.5 if s else 0.0, "tokens_per_s": 1000.0, "samples_per_s": 64.0,
             "train/mfu": mfu, "len_trained_mean": 5.0, "len_trained_n": 16, "len_dropped_stale_mean": None,
             "len_dropped_stale_n": 0, "len_dropped_filtered_mean": 7.0 if s == 2 else None,
             "len_dropped_filtered_n": 8 if s == 2 else 0, "staleness/samples_0": 8, "staleness/samples_1": 8,
             "fleet_size": [1, 3, 3, 1][s], "engines_joined": [0, 2, 2, 2][s], "engines_left": [0, 0, 0, 2][s],
             "requests_reissued": [0, 0, 0, 5][s]}
            for s in range(4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text("loss:\n  name: tis   # <kept verbatim>\n")
    if evals:
        (path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/sort4/pass@1": 0.1 * s,
                                                             "eval/sort4/pass@4": 0.2 * s}) + "\n" for s in (0, 2)))


def sections(page: str) -> dict[str, str]:
    return dict(re.findall(r"<section id='([a-z-]+)'>(.*?)</section>", page, re.S))


def test_every_section_with_its_figure(tmp_path) -> None:
    write_run(tmp_path / "run", mfu=0.31)
    page = report.build_report(str(tmp_path / "run"))
    found = sections(page)
    assert set(report.SECTIONS) | {"summary"} == set(found)
    for title in TITLES:
        assert f"<h2>{title}</h2>" in page
    for name in set(report.SECTIONS) - {"config"}:
        (png,) = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", found[name])
        assert base64.b64decode(png).startswith(b"\x89PNG"), name
    assert "&lt;kept verbatim&gt;" in found["config"]  # escaped, not markup
    assert "no trace" in found["summary"]
    assert "1 / 3 / 1" in found["summary"] and "2 / 2, 5" in found["summary"]  # min / max / end; joined / left


def test_what_is_missing_is_said(tmp_path) -> None:
    write_run(tmp_path / "cpu", mfu=None, evals=False)
    found = sections(report.build_report(str(tmp_path / "cpu")))
    assert "not reported" in found["mfu"] and "data:image" not in found["mfu"]
    assert "no evaluation" in found["eval"] and "data:image" not in found["eval"]


def test_stage_times_add_up_to_the_step() -> None:
    rows = [{"step": 0, "time_rollout_wait": 0.5, "time_train": 1.0, "time_sync": 0.4, "time_probe": 0.1,
             "time_step": 2.0}]
    stages = report.stage_times(rows)
    assert {k: v[0] for k, v in stages.items()} == pytest.approx({"wait": 0.5, "train": 1.0, "sync": 0.3,
                                                                  "probe": 0.1, "other": 0.1})
    assert report.staleness_counts([{"staleness/samples_0": 3}, {"staleness/samples_0": 1, "staleness/samples_2": 4}]) \
        == {0: 4, 2: 4}


def test_cli_writes_the_page_and_refuses_a_non_run(tmp_path) -> None:
    write_run(tmp_path / "run")
    proc = run_tool(["tools/report.py", str(tmp_path / "run")])
    assert proc.stdout.strip().endswith("report.html") and (tmp_path / "run" / "report.html").stat().st_size > 10_000
    bad = run_tool(["tools/report.py", str(tmp_path)], check=False)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
