"""Run by test_routing_replay.py (plain python or torchrun): the trainer's logprobs of engine samples
with its routers perturbed or not, routing replay on or off; prints per case the routing agreement
and the largest |trainer − engine| logprob over the sampled tokens."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from megatron_flash.trainer.model_builder import MoEOptions, ScaleOptions  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from megatron_flash.trainer.routing_replay import routers_of  # noqa: E402
from megatron_flash.types import Sample, collate  # noqa: E402


def main() -> None:
    hf_dir, samples_path, tp, ep, pack = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "pack"
    records = torch.load(samples_path)
    samples = [Sample(**r) for r in records]
    batch = collate(samples, pad_id=0)
    policy = MegatronPolicy(PolicySettings(
        hf_path=hf_dir, tp_size=tp, micro_batch_size=2, pack_sequences=pack,
        scale=ScaleOptions(sequence_parallel=tp > 1),
        moe=MoEOptions(ep_size=ep, aux_loss_coeff=0.0, routing_replay=True)))
    response = batch.loss_mask.bool()

    def case(replay: bool) -> dict:
        policy.routing.replay = replay
        lp, _ = policy.compute_logprobs(batch)
        agreement = policy.routing.collect(policy.device)
        diff = (lp - batch.behavior_logprobs).abs()[response]
        return {**agreement, "max_diff": float(diff.max()), "mean_diff": float(diff.mean())}

    out = {"plain": {"off": case(False), "on": case(True)}}
    gen = torch.Generator().manual_seed(11)  # same draw on every rank: router weights are replicated
    for chunk in policy.chunks:
        for router in routers_of(chunk):
            router.weight.data += 0.02 * torch.randn(router.weight.shape, generator=gen).to(router.weight)
    out["perturbed"] = {"off": case(False), "on": case(True)}
    if dist.get_rank() == 0:
        print(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
