"""Run under torchrun (or plain python for 1×1) by test_checkpoint_layouts.py.

--mode save:   one Adam step on batch A, a run checkpoint (megatron_flash.trainer.checkpoint.save), then a
               second step on batch B; writes metrics.json (both losses) and export_after/ (HF weights
               after step 2) into --out: the uninterrupted run.
--mode resume: a fresh policy in this process's layout loads that checkpoint and takes the step on
               batch B; writes the same files. The test compares the two.
--batches:     the seeds of the steps after the checkpoint (default "2": batch B); their losses go to
               metrics.json "losses". --resave-dir: resume mode saves again after those steps, so a
               later launch in yet another layout can resume from this one (a chain of layouts).
--cases FILE:  several of the above in one launch, one after the other (grouped_cases.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_flash.config.schema import OptimizerConfig  # noqa: E402
from megatron_flash.trainer import checkpoint as ckpt  # noqa: E402
from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from megatron_flash.trainer.lora import LoraOptions  # noqa: E402
from megatron_flash.trainer.model_builder import ScaleOptions  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from megatron_flash.types import TrainBatch  # noqa: E402
from tests.distributed.grouped_cases import read_cases  # noqa: E402
from tests.distributed.layout_worker import weighted_nll  # noqa: E402


def batch(vocab: int, seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (8, 16), generator=gen)
    mask = torch.zeros(8, 16)
    for i in range(8):
        mask[i, 4: 6 + i] = 1.0
    # weighted_nll weights each token's logprob by its `advantages` entry
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=torch.randn(8, 16, generator=gen))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["save", "resume"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (base frozen)")
    p.add_argument("--batches", default="2", help="comma-separated seeds of the steps after the checkpoint")
    p.add_argument("--resave-dir", default="", help="resume mode: save a checkpoint here after the steps")
    return p


def run_case(args: argparse.Namespace) -> None:
    policy = MegatronPolicy(PolicySettings(
        hf_path=args.hf_dir, tp_size=args.tp, pp_size=args.pp, micro_batch_size=2, optimizer_steps=10,
        optimizer=OptimizerConfig(name="adam", lr=1e-2, clip_grad=1e6, lr_warmup_steps=3,
                                  use_distributed_optimizer=args.distributed_optimizer),
        lora=LoraOptions(rank=args.lora_rank), scale=ScaleOptions(context_parallel_size=args.cp),
    ))
    vocab = policy.spec.vocab_size
    out: dict = {}
    seeds = [int(x) for x in args.batches.split(",")]
    if args.mode == "save":
        out["loss_a"] = policy.train_step(batch(vocab, 1), weighted_nll)["loss"]
        ckpt.save(policy, args.ckpt_dir, step=0, version=1, rollout_state={"probe": 1})
        import psutil

        # Processes the save left behind (would be orphaned by a kill -9 of this rank).
        out["children_after_save"] = len(psutil.Process().children(recursive=True))
        policy.export_hf(os.path.join(args.out, "export_before"))
    else:
        meta, rollout = ckpt.load(policy, ckpt.latest_checkpoint(args.ckpt_dir))
        out["saved_tp"], out["saved_pp"], out["saved_cp"] = meta["tp"], meta["pp"], meta.get("cp", 1)
        out["rollout_probe"] = (rollout or {}).get("probe", -1) if dist.get_rank() == 0 else -1
    out["lr"] = policy.scheduler.get_lr(policy.optimizer.param_groups[0])
    out["losses"] = [policy.train_step(batch(vocab, seed), weighted_nll)["loss"] for seed in seeds]
    out["loss_b"] = out["losses"][0]
    if args.mode == "resume" and args.resave_dir:
        ckpt.save(policy, args.resave_dir, step=len(seeds), version=1 + len(seeds), rollout_state={"probe": 2})
    policy.export_hf(os.path.join(args.out, "export_after"))
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(out, f)


def main() -> None:
    for name, argv in read_cases(sys.argv[1:]).items():
        try:
            run_case(parser().parse_args(argv))
        except BaseException:
            print(f"ckpt_layout_worker: case {name!r} failed: {' '.join(argv)}", file=sys.stderr, flush=True)
            raise
        gc.collect()  # the previous case's model and optimizer state
    destroy_distributed()


if __name__ == "__main__":
    main()
