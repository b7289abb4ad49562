"""A batch whose advantages are all zero, through the real Megatron trainer on two gloo ranks (DP2):
the optimizer does not step (weights, Adam's moments and step count bit-identical), the LR schedule
advances, and train/zero_grad_skipped says so on every rank. With optimizer.skip_zero_grad=false the
same batch steps, and Adam's moments decay exactly by β1 and β2 (the reference is that arithmetic,
not the trainer), while weight decay moves the weights.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.conftest import json_rows, run_tool  # noqa: E402

SCRIPT = os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BETA1, BETA2 = 0.9, 0.95


def test_a_zero_gradient_leaves_the_optimizer_untouched_unless_told_otherwise(tiny_models) -> None:
    proc = run_tool([SCRIPT, "--model-path", tiny_models["llama"]], nproc=2)
    rows = json_rows(proc.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1], proc.stdout[-2000:]
    for r in rows:
        assert r["warm"] == {"update_ok": 1.0, "zero_grad_skipped": 0.0, "nonfinite_skipped": 0.0}, r
        assert r["skipped"] == {"update_ok": 0.0, "zero_grad_skipped": 1.0, "nonfinite_skipped": 0.0}, r
        assert r["skipped_grad_norm"] == 0.0
        assert r["weights_unchanged_when_skipped"] is True
        assert r["state_unchanged_when_skipped"] is True and r["state_tensors"] > 0
        assert r["lr_steps_when_skipped"] == 1
        assert r["stepped"] == {"update_ok": 1.0, "zero_grad_skipped": 0.0, "nonfinite_skipped": 0.0}, r
        # Adam on g = 0: m ← β1·m, v ← β2·v
        assert r["exp_avg_ratio"] and max(abs(x - BETA1) for x in r["exp_avg_ratio"]) < 1e-6, r
        assert r["exp_avg_sq_ratio"] and max(abs(x - BETA2) for x in r["exp_avg_sq_ratio"]) < 1e-6, r
        assert r["weights_moved_when_stepped"] > 0  # weight decay, with nothing learned


def _main() -> int:
    import argparse
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import get_loss
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch

    optimizer = OptimizerConfig(name="adam", lr=1e-2, weight_decay=0.1, adam_beta1=BETA1, adam_beta2=BETA2)
    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, micro_batch_size=2, optimizer=optimizer))
    loss_fn = make_loss_fn(get_loss("tis"))
    rank = dist.get_rank()

    def batch(advantage: float) -> TrainBatch:
        gen = torch.Generator().manual_seed(0)  # the same rows on both ranks; each trains its half
        tokens = torch.randint(4, policy.spec.vocab_size, (4, 10), generator=gen)
        mask = torch.zeros(4, 10)
        mask[:, 4:] = 1
        return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=torch.full((4, 10), -2.0) * mask,
                          advantages=torch.full((4, 10), advantage) * mask)

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in policy.chunks[0].named_parameters()}

    def adam_state() -> list[tuple[str, torch.Tensor]]:
        inner = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
        out = []
        for opt in inner:
            for i, state in enumerate(opt.optimizer.state.values()):
                for key, value in sorted(state.items()):
                    if torch.is_tensor(value):
                        out.append((f"{i}.{key}", value.detach().clone()))
        return out

    def flags(metrics: dict) -> dict:
        return {k: metrics[k] for k in ("update_ok", "zero_grad_skipped", "nonfinite_skipped")}

    out: dict = {"rank": rank}
    try:
        out["warm"] = flags(policy.train_step(batch(1.0), loss_fn))  # Adam now holds non-zero moments
        w0, s0, lr0 = weights(), adam_state(), policy.scheduler.num_steps
        skipped = policy.train_step(batch(0.0), loss_fn)
        out["skipped"], out["skipped_grad_norm"] = flags(skipped), skipped["grad_norm"]
        w1, s1 = weights(), adam_state()
        out["weights_unchanged_when_skipped"] = all(torch.equal(w0[k], w1[k]) for k in w0)
        out["state_unchanged_when_skipped"] = len(s0) == len(s1) and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(s0, s1))
        out["state_tensors"] = len(s0)
        out["lr_steps_when_skipped"] = policy.scheduler.num_steps - lr0

        policy.settings.optimizer.skip_zero_grad = False
        out["stepped"] = flags(policy.train_step(batch(0.0), loss_fn))
        w2, s2 = weights(), adam_state()
        ratios: dict[str, list[float]] = {"exp_avg": [], "exp_avg_sq": []}
        for (name, before), (_, after) in zip(s1, s2):
            kind = name.split(".", 1)[1]
            if kind in ratios and before.abs().max() > 0:
                nz = before != 0
                ratio = (after[nz] / before[nz]).double()
                ratios[kind] += [float(ratio.min()), float(ratio.max())]
        out["exp_avg_ratio"], out["exp_avg_sq_ratio"] = ratios["exp_avg"], ratios["exp_avg_sq"]
        out["weights_moved_when_stepped"] = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
        print(json.dumps(out), flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
