"""Run by test_moe_metrics.py (plain python or torchrun): the trainer's MoE metrics of one step, and
the same expert-load statistic computed independently with transformers' router on the same tokens."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_flash.config.schema import OptimizerConfig  # noqa: E402
from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from megatron_flash.trainer.loss_adapter import nll_loss_fn  # noqa: E402
from megatron_flash.trainer.model_builder import MoEOptions  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from megatron_flash.types import TrainBatch  # noqa: E402


def hf_expert_load(hf_dir: str, tokens: torch.Tensor, lengths: list[int]) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    experts = model.config.num_experts
    counts = [torch.zeros(experts) for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        def hook(module, inputs, output, i=i):  # output: (logits, top-k weights, top-k expert ids)
            counts[i] += torch.bincount(output[2].flatten(), minlength=experts).float()
        layer.mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        for row, n in zip(tokens, lengths):  # each sample alone, its real tokens only
            model(row[:n].unsqueeze(0))
    return float(torch.stack([c.max() / c.mean() for c in counts]).mean())


def main() -> None:
    hf_dir, ep = sys.argv[1], int(sys.argv[2])
    policy = MegatronPolicy(PolicySettings(hf_path=hf_dir, micro_batch_size=3, optimizer=OptimizerConfig(name="sgd", lr=0.1),
                                           moe=MoEOptions(ep_size=ep, aux_loss_coeff=0.0 if ep > 1 else None)))
    gen = torch.Generator().manual_seed(5)
    lengths = [12, 7, 9, 12, 5, 10]
    tokens = torch.randint(4, policy.spec.vocab_size, (6, 12), generator=gen)
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).float()
    metrics = policy.train_step(TrainBatch(tokens=tokens, lengths=torch.tensor(lengths), loss_mask=mask), nll_loss_fn)
    if dist.get_rank() == 0:
        print(json.dumps({"trainer": metrics, "hf_expert_load_max": hf_expert_load(hf_dir, tokens, lengths)}))
    destroy_distributed()


if __name__ == "__main__":
    main()
