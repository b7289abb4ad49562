"""Autoregressive sampling with the Megatron policy itself (no engine): small models and tests only.

Every step re-runs the full forward (no KV cache), so the cost grows with length²; that is fine for
the few-token synthetic tasks and gives the synchronous on-policy reference loop a sampler that is
exactly the trained policy. Every rank computes the same logits (the policy shares them), and all
ranks draw with identically seeded generators, so all ranks sample the same tokens.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Sampled:
    prompt_ids: list[int]
    response_ids: list[int]  # includes the end token when finished
    behavior_logprobs: list[float]  # log μ(token) at the sampling temperature, per response token
    finished: bool


@torch.no_grad()
def sample(policy, prompts: list[list[int]], *, max_new_tokens: int, eos_id: int, pad_id: int,
           temperature: float = 1.0, generator: torch.Generator) -> list[Sampled]:
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    total = int(lengths.max()) + max_new_tokens
    tokens = torch.full((n, total), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    out = [Sampled(list(p), [], [], False) for p in prompts]
    active = torch.ones(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        was_active = active.clone()
        width = int(lengths.max())
        logits = policy.compute_logits(tokens[:, :width]).double()
        last = logits[torch.arange(n), lengths - 1] / temperature
        logp = torch.log_softmax(last, dim=-1)
        picked = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        for i in torch.nonzero(active).flatten().tolist():
            tok = int(picked[i])
            out[i].response_ids.append(tok)
            out[i].behavior_logprobs.append(float(logp[i, tok]))
            tokens[i, lengths[i]] = tok
            if tok == eos_id:
                out[i].finished = True
                active[i] = False
        lengths = lengths + was_active.long()
        if not bool(active.any()):
            break
    return out
