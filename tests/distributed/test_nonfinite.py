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

from tests.conftest import run_tool  # noqa: E402

SCRIPT = os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_nonfinite_gradient_skips_the_update(tiny_models) -> None:
    out = json.loads(run_tool([SCRIPT, "--model-path", tiny_models["llama"]]).stdout.strip().splitlines()[-1])
    assert out["poisoned"]["nonfinite_skipped"] == 1.0 and out["poisoned"]["update_ok"] == 0.0, out
    assert out["unchanged_after_poison"] is True and out["lr_steps_after_poison"] == 0
    assert out["clean"]["nonfinite_skipped"] == 0.0 and out["clean"]["update_ok"] == 1.0
    assert out["moved_after_clean"] > 0 and out["finite_after_clean"] is True


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


if __name__ == "__main__":
    sys.exit(_main())
