"""Context parallelism's flash path on CUDA (torch's varlen attention over the plan of
trainer/context_parallel.py). One GPU: every CP rank's local queries attend, through the plan's cu_q,
cu_k and key indices, to the keys all ranks hold, gathered in rank order as the all-gather gives them;
the result must be causal attention within each sequence of the whole row (torch's SDPA per sequence,
bf16: within bf16 noise). Two GPUs: the CP2 trainer (NCCL, flash, bf16) against CP1 on the same batch."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu(1)
@pytest.mark.parametrize("cp_size", [2, 4])
def test_flash_plan_is_causal_attention_of_the_whole_sequences(cp_size: int) -> None:
    from megatron_flash.trainer.context_parallel import split
    from megatron_flash.trainer.flash_attention import _varlen_kwargs

    varlen_attn, causal, _ = _varlen_kwargs()
    lengths = [2 * cp_size * 40, 2 * cp_size, 2 * cp_size * 7, 2 * cp_size * 129]
    heads, dim = 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    want = torch.empty_like(q)
    start = 0
    for n in lengths:
        seq = slice(start, start + n)
        want[seq] = torch.nn.functional.scaled_dot_product_attention(
            q[seq].transpose(0, 1), k[seq].transpose(0, 1), v[seq].transpose(0, 1), is_causal=True).transpose(0, 1)
        start += n
    parts = [split(lengths, cp_size=cp_size, rank=r) for r in range(cp_size)]
    index = [p.local_index.cuda() for p in parts]
    k_all, v_all = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    for p, i in zip(parts, index):
        plan = p.flash_plan
        keys = plan["k_index"].cuda()
        out = varlen_attn(q[i], k_all[keys], v_all[keys], plan["cu_q"].cuda(), plan["cu_k"].cuda(),
                          int(plan["max_q"]), int(plan["max_k"]), scale=dim ** -0.5, **causal)
        assert (out.float() - want[i].float()).abs().max().item() <= 2e-2


@pytest.mark.gpu(2)
def test_cp2_flash_trainer_matches_cp1(tiny_models, tmp_path) -> None:
    import json
    import os

    from tests.conftest import run_tool

    out = {}
    for cp in (1, 2):
        out[cp] = str(tmp_path / f"cp{cp}")
        os.makedirs(out[cp])
        run_tool(["tests/distributed/layout_worker.py", "--hf-dir", tiny_models["llama"], "--steps", "2", "--lr", "1",
                  "--micro-batch-size", "4", "--cp", str(cp), "--dtype", "bfloat16", "--attention-backend", "flash",
                  "--out", out[cp]], nproc=cp, timeout=600)
    lp1, lp2 = (torch.load(os.path.join(out[c], "logprobs.pt")) for c in (1, 2))
    assert (lp1 - lp2).abs().max().item() <= 2e-2
    m1, m2 = (json.load(open(os.path.join(out[c], "metrics.json"))) for c in (1, 2))
    assert abs(m1["losses"][0] - m2["losses"][0]) <= 2e-2 * max(1.0, abs(m1["losses"][0]))
