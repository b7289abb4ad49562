"""Tracker: metrics.jsonl round-trips, TensorBoard scalars read back with TensorBoard's own reader,
W&B offline writes its run folder under run_dir, disabled sinks and non-zero ranks write nothing,
and a failing sink warns instead of stopping the run."""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import pytest

from megatron_flash import tracking
from megatron_flash.config.schema import LoggingConfig
from megatron_flash.tracking import Tracker


def cfg(**overrides) -> LoggingConfig:
    return LoggingConfig(**{"wandb_mode": "disabled", "tensorboard": False, "log_interval": 1, **overrides})


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracking, "_warned", set())


def test_jsonl_lines_equal_what_was_logged(tmp_path) -> None:
    logged = [(1, {"loss": 0.5, "reward_mean": 0.25, "num_samples": 16}),
              (2, {"loss": 0.25, "reward_mean": 0.5, "num_samples": 16, "rollout/tokens_per_s": 123.5})]
    with Tracker(str(tmp_path), cfg(), total_steps=2) as tracker:
        for step, metrics in logged:
            tracker.log(step, metrics)
        # Line-buffered: each step is on disk before close.
        assert len(read_jsonl(str(tmp_path / "metrics.jsonl"))) == 2
    lines = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert lines == [{"step": step, **metrics} for step, metrics in logged]
    assert all(list(line)[0] == "step" for line in lines)
    assert isinstance(lines[0]["num_samples"], int)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # W&B and TensorBoard off: nothing else


def test_non_finite_and_odd_values_become_null(tmp_path, caplog) -> None:
    import torch

    with Tracker(str(tmp_path), cfg(), total_steps=1) as tracker, caplog.at_level(logging.WARNING):
        tracker.log(1, {"nan": float("nan"), "inf": math.inf, "ninf": -math.inf, "none": None, "text": "x",
                        "tensor": torch.tensor(1.5), "flag": True})
        with pytest.raises(ValueError, match="'step'"):
            tracker.log(2, {"step": 3})
    (line,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert line == {"step": 1, "nan": None, "inf": None, "ninf": None, "none": None, "text": None,
                    "tensor": 1.5, "flag": 1}
    assert "'text' is not a number" in caplog.text


def test_tensorboard_scalars_read_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(str(tmp_path), cfg(tensorboard=True, log_interval=2), total_steps=5) as tracker:
        for step in range(1, 6):
            tracker.log(step, {"loss": 1.0 / step, "rollout/reward_mean": step / 10, "bad": float("nan")})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "rollout/reward_mean"}  # NaN is not plotted
    # Every log_interval-th step, plus the last one; metrics.jsonl has them all.
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (2, pytest.approx(0.5)), (4, pytest.approx(0.25)), (5, pytest.approx(0.2))]
    assert [e.value for e in events.Scalars("rollout/reward_mean")] == pytest.approx([0.2, 0.4, 0.5])
    assert [line["step"] for line in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4, 5]


def test_histograms_and_side_metrics_read_back_and_stay_out_of_the_jsonl(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(str(tmp_path), cfg(tensorboard=True), total_steps=3) as tracker:
        tracker.log(0, {"loss": 1.0})
        tracker.log_histograms(0, {"mismatch/token_log_ratio": [0.1, -0.2, 0.3, float("nan")], "empty": []})
        tracker.log_side(0, {"eval/sort4/pass@1": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert events.Tags()["histograms"] == ["mismatch/token_log_ratio"]  # NaN dropped, empty skipped
    hist = events.Histograms("mismatch/token_log_ratio")[0].histogram_value
    assert hist.num == 3 and hist.min == pytest.approx(-0.2) and hist.max == pytest.approx(0.3)
    assert [e.value for e in events.Scalars("eval/sort4/pass@1")] == [0.5]
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 0, "loss": 1.0}]


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with caplog.at_level(logging.WARNING):
        for run in ("a", "b"):
            with Tracker(str(tmp_path / run), cfg(tensorboard=True), total_steps=1) as tracker:
                tracker.log(1, {"loss": 1.0})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "logging.tensorboard" in warnings[0]
    assert not (tmp_path / "a" / "tensorboard").exists()
    assert read_jsonl(str(tmp_path / "b" / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]


def test_wandb_offline_writes_its_run_under_run_dir(tmp_path, monkeypatch) -> None:
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    with Tracker(str(run_dir), cfg(wandb_mode="offline"), total_steps=2, config={"lr": 1e-3}) as tracker:
        tracker.log(1, {"loss": 0.5})
        tracker.log(2, {"loss": 0.25})
    runs = [d for d in os.listdir(run_dir / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1, os.listdir(run_dir / "wandb")
    assert any(f.endswith(".wandb") for f in os.listdir(run_dir / "wandb" / runs[0]))


def test_wandb_init_failure_warns_and_continues(tmp_path, monkeypatch, caplog) -> None:
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with caplog.at_level(logging.WARNING), Tracker(str(tmp_path), cfg(wandb_mode="online"), total_steps=1) as t:
        t.log(1, {"loss": 1.0})
    assert "logging.wandb_mode=online" in caplog.text and "api_key not configured" in caplog.text
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]
    assert not (tmp_path / "wandb").exists()


def test_non_zero_rank_writes_nothing(tmp_path) -> None:
    run_dir = tmp_path / "run"
    tracker = Tracker(str(run_dir), cfg(tensorboard=True, wandb_mode="offline"), total_steps=3, rank=1)
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    tracker.close()  # idempotent
    assert not run_dir.exists()


def test_close_is_idempotent_and_later_logs_are_ignored(tmp_path) -> None:
    tracker = Tracker(str(tmp_path), cfg(tensorboard=True), total_steps=3)
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    tracker.close()
    tracker.log(2, {"loss": 2.0})
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]


def test_progress_bar_shows_key_metrics(tmp_path) -> None:
    with Tracker(str(tmp_path), cfg(log_interval=2), total_steps=4) as tracker:
        tracker.log(1, {"reward_mean": 0.1})
        assert tracker._bar.n == 1 and tracker._bar.postfix is None  # not a log_interval step
        tracker.log(2, {"rollout/reward_mean": 0.5, "staleness_mean": 1.25, "loss": 3.0})
        assert tracker._bar.n == 2
        assert tracker._bar.postfix == "reward_mean=0.5, staleness_mean=1.25"
