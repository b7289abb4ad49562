"""A poisoned batch (NaN advantages on trained tokens, so NaN loss and gradients) through the real
Megatron trainer: the optimizer step is skipped (weights bit-identical, the LR schedule not
advanced), reported as train metrics, and the next clean batch trains. Then the controller's rule:
N skipped steps in a row stop the run with the batch dumped.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.conftest import json_rows, run_tool  # noqa: E402

SCRIPT = os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_nonfinite_gradient_skips_the_update(tiny_models) -> None:
    out = json.loads(run_tool([SCRIPT, "--model-path", tiny_models["llama"]]).stdout.strip().splitlines()[-1])
    assert out["poisoned"]["nonfinite_skipped"] == 1.0 and out["poisoned"]["update_ok"] == 0.0, out
    assert out["unchanged_after_poison"] is True and out["lr_steps_after_poison"] == 0
    assert out["clean"]["nonfinite_skipped"] == 0.0 and out["clean"]["update_ok"] == 1.0
    assert out["moved_after_clean"] > 0 and out["finite_after_clean"] is True


def test_blown_up_weights_after_a_finite_update_are_flagged_on_every_rank(tiny_models) -> None:
    """DP2 (two gloo ranks). Each case's gradients are finite, so the update runs; then the weights are
    bad on one rank only (inf, or finite 1e30) or on both (learning rate 1e30): every rank must report
    it, and a clean step must not."""
    proc = run_tool([SCRIPT, "--model-path", tiny_models["llama"], "--blow-up"], nproc=2)
    rows = json_rows(proc.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1], proc.stdout[-2000:]
    for r in rows:
        assert r["clean"] == {"nonfinite_skipped": 0.0, "update_ok": 1.0, "weights_nonfinite": 0.0}, r
        for case in ("inf_on_rank0", "huge_on_rank1", "lr_1e30"):
            assert r[case] == {"nonfinite_skipped": 0.0, "update_ok": 1.0, "weights_nonfinite": 1.0}, (case, r)
        assert r["largest_weight_after_lr_1e30"] > 1e20  # finite gradients really blew the weights up


def test_blown_up_weights_stop_the_run_before_the_push_naming_version_and_last_checkpoint(tmp_path) -> None:
    from megatron_flash.controller import Controller
    from megatron_flash.controller.checkpoints import Checkpoints
    from megatron_flash.trainer import checkpoint as ckpt

    ckpts = Checkpoints(SimpleNamespace(save_dir=str(tmp_path / "ckpt")), policy=None, run_dir=str(tmp_path),
                        rank=0, ctrl_group=None, mode=None)
    assert ckpts.last_good() == "none saved by this run (it started from model.hf_path)"
    saved = tmp_path / "ckpt" / "step_000004"
    saved.mkdir(parents=True)
    (saved / "meta.json").write_text("{}")
    (tmp_path / "ckpt" / ckpt.LATEST).write_text("step_000004")
    ctl = SimpleNamespace(version=5, _trained=False, checkpoints=ckpts)
    Controller._stop_on_blown_up_weights(ctl, {"weights_nonfinite": 0.0})  # a good step goes on
    with pytest.raises(RuntimeError) as info:
        Controller._stop_on_blown_up_weights(ctl, {"weights_nonfinite": 1.0})
    message = str(info.value)
    assert "the optimizer step at policy version 5 left non-finite weights" in message
    assert "the engines still serve version 5" in message
    assert f"Last good checkpoint: {saved} (checkpoint.resume=true resumes it)" in message
    assert ctl._trained  # an export at the stop labels the weights with the version they are (6)


def test_the_run_stops_after_max_nonfinite_steps_in_a_row_with_the_batch_dumped(tmp_path) -> None:
    import torch

    from megatron_flash.controller import Controller
    from megatron_flash.types import TrainBatch

    ctl = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(max_nonfinite_steps=3)), version=7,
                          run_dir=str(tmp_path), rank=0, _nonfinite_run=0)
    batch = TrainBatch(tokens=torch.tensor([[1, 2, 3]]), loss_mask=torch.ones(1, 3),
                       advantages=torch.tensor([[float("nan")] * 3]))
    bad, good = {"nonfinite_skipped": 1.0}, {"nonfinite_skipped": 0.0}
    for metrics in (bad, bad, good, bad, bad):  # a clean step in between resets the count
        Controller._note_nonfinite(ctl, metrics, batch)
    with pytest.raises(RuntimeError, match=r"3 optimizer steps in a row had a non-finite gradient "
                                           r"\(trainer.max_nonfinite_steps=3\) at policy version 7"):
        Controller._note_nonfinite(ctl, bad, batch)
    dumped = [json.loads(line) for line in open(tmp_path / "nonfinite_batch_v7.jsonl")]
    assert dumped[0]["tokens"] == [1, 2, 3] and all(v != v for v in dumped[0]["advantages"])  # NaN kept


def _main() -> int:
    import argparse
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--blow-up", action="store_true", help="the blown-up-weights cases (run under torchrun, DP2)")
    args = p.parse_args()

    import torch

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import get_loss
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch

    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, micro_batch_size=4,
                                           optimizer=OptimizerConfig(name="adam", lr=1e-2)))
    loss_fn = make_loss_fn(get_loss("reinforce"))

    def batch(advantage: float) -> TrainBatch:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(4, policy.spec.vocab_size, (4, 10), generator=gen)
        mask = torch.zeros(4, 10)
        mask[:, 4:] = 1
        return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=torch.full((4, 10), -2.0) * mask,
                          advantages=torch.full((4, 10), advantage) * mask + torch.zeros(4, 10))

    def weights() -> dict:
        return {n: p.detach().clone() for n, p in policy.chunks[0].named_parameters()}

    if args.blow_up:
        return _blow_up(policy, batch(1.0), loss_fn)
    out = {}
    try:
        before = weights()
        steps_before = policy.scheduler.num_steps
        poisoned = batch(1.0)
        poisoned = poisoned.replace(advantages=torch.where(poisoned.loss_mask > 0, float("nan"), 0.0))
        out["poisoned"] = policy.train_step(poisoned, loss_fn)
        after = weights()
        out["unchanged_after_poison"] = all(torch.equal(before[k], after[k]) for k in before)
        out["lr_steps_after_poison"] = policy.scheduler.num_steps - steps_before
        out["clean"] = policy.train_step(batch(1.0), loss_fn)
        moved = weights()
        out["moved_after_clean"] = max((moved[k] - after[k]).abs().max().item() for k in moved)
        out["finite_after_clean"] = all(bool(torch.isfinite(v).all()) for v in moved.values())
        out = {k: ({m: v[m] for m in ("nonfinite_skipped", "update_ok")} if isinstance(v, dict) else v)
               for k, v in out.items()}
        print(json.dumps(out), flush=True)
    finally:
        destroy_distributed()
    return 0


def _blow_up(policy, batch, loss_fn) -> int:
    """Train steps whose update leaves the weights bad (see the test); prints this rank's flags."""
    import torch
    import torch.distributed as dist

    from megatron_flash.trainer.distributed import destroy_distributed

    rank = dist.get_rank()
    step = policy.optimizer.step
    param = next(policy.chunks[0].parameters())

    def then(rank_to_poison: int, value: float):
        def poisoned_step():
            result = step()
            if rank == rank_to_poison:
                with torch.no_grad():
                    param.view(-1)[0] = value  # this rank's copy only: the others' stay fine
            return result
        return poisoned_step

    def flags(metrics: dict) -> dict:
        return {k: metrics[k] for k in ("nonfinite_skipped", "update_ok", "weights_nonfinite")}

    out = {"rank": rank}
    try:
        out["clean"] = flags(policy.train_step(batch, loss_fn))
        for case, rank_to_poison, value in (("inf_on_rank0", 0, float("inf")), ("huge_on_rank1", 1, 1e30)):
            good = param.detach().clone()
            policy.optimizer.step = then(rank_to_poison, value)
            out[case] = flags(policy.train_step(batch, loss_fn))
            policy.optimizer.step = step
            with torch.no_grad():
                param.copy_(good)
        for group in policy.optimizer.param_groups:
            group["lr"] = 1e30
        out["lr_1e30"] = flags(policy.train_step(batch, loss_fn))
        out["largest_weight_after_lr_1e30"] = max(p.detach().abs().max().item() for p in policy.chunks[0].parameters())
        print(json.dumps(out), flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
