"""trainer.shared_prefix on CUDA with the flash backend (torch's varlen attention with the responses'
keys gathered as [prompt; own] and their own key offsets, bottom-right causal): the same logprobs and
gradients as the unshared packed rows, in bf16 (outputs within bf16 noise, gradient cosine ≥ 0.999),
on layout_worker's grouped batch (a group split by the token budget, a group of one)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu(1)
def test_flash_shared_prefix_matches_unshared(tiny_models) -> None:
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from tests.distributed.layout_worker import grouped_batch, weighted_nll

    out = {}
    for shared in (False, True):
        policy = MegatronPolicy(PolicySettings(
            hf_path=tiny_models["llama"], dtype="bfloat16", attention_backend="flash", shared_prefix=shared,
            micro_batch_size=8, max_tokens_per_micro_batch=24, optimizer=OptimizerConfig(name="sgd", lr=1.0, clip_grad=1e6)))
        batch = grouped_batch(policy.spec.vocab_size)
        logprobs, _ = policy.compute_logprobs(batch)
        before = [p.detach().float().clone() for p in policy.chunks[0].parameters()]
        metrics = policy.train_step(batch, weighted_nll)
        step = torch.cat([(b - p.detach().float()).flatten() for b, p in zip(before, policy.chunks[0].parameters())])
        out[shared] = (logprobs, metrics, step)
        destroy_distributed()
    (lp0, m0, g0), (lp1, m1, g1) = out[False], out[True]
    assert (lp0 - lp1).abs().max().item() <= 2e-2
    assert abs(m0["loss"] - m1["loss"]) <= 2e-2 * max(1.0, abs(m0["loss"]))
    assert float(torch.nn.functional.cosine_similarity(g0, g1, dim=0)) >= 0.999
    assert m1["tokens_computed"] < m0["tokens_computed"]
