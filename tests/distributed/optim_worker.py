"""Run by test_optimizer.py (plain python, TP1): clipping and LR schedule numbers as one JSON line."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_flash.config.schema import OptimizerConfig  # noqa: E402
from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from tests.distributed.layout_worker import fixed_batch, weighted_nll  # noqa: E402


def flat_params(policy: MegatronPolicy) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().clone() for p in policy.model.module.parameters()])


def main() -> None:
    hf_dir = sys.argv[1]
    clip = MegatronPolicy(PolicySettings(hf_path=hf_dir, micro_batch_size=8,
                                          optimizer=OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.01)))
    batch = fixed_batch(clip.spec.vocab_size)
    before = flat_params(clip)
    m = clip.train_step(batch, weighted_nll)
    update_norm = (flat_params(clip) - before).norm().item()

    sched = MegatronPolicy(PolicySettings(
        hf_path=hf_dir, optimizer_steps=6, micro_batch_size=8,
        optimizer=OptimizerConfig(name="sgd", lr=0.1, min_lr=0.01, lr_warmup_steps=2, lr_decay_style="cosine",
                                  clip_grad=1e6)))
    lrs = [sched.train_step(batch, weighted_nll)["lr"] for _ in range(6)]
    print(json.dumps({"grad_norm": m["grad_norm"], "update_norm": update_norm, "lrs": lrs}))
    destroy_distributed()


if __name__ == "__main__":
    main()
