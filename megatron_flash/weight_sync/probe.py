"""Post-sync probe: does an engine compute the trainer's logprobs after a sync?

A few fixed token sequences (deterministic, drawn from the vocabulary with a fixed seed) are split
into a prompt and a continuation. The engine scores the continuation teacher-forced through SGLang's
input logprobs, the trainer through `policy.compute_logprobs`; the per-token difference is the
train/inference mismatch of the weights just pushed (≈1e-5 in fp32; a wrong name map, a missed
bucket or a stale engine shows up as O(1)).

Engine request (SGLang 0.5.23 `/generate`, one batch):
    {"input_ids": [[prompt + continuation], ...], "return_logprob": true,
     "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
→ per sequence `meta_info.input_token_logprobs` = [[logprob|null, token_id, text|null], ...] for
input positions len(prompt)-1 … end. SGLang always reports null for the first listed position
(its logits start there), so start one token early and drop that entry.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

import torch

from megatron_flash.engines.client_base import MalformedReply
from megatron_flash.engines.client_replies import parse_input_logprobs

NUM_SEQUENCES = 4
PROMPT_LEN = 8
CONTINUATION_LEN = 8
SEED = 20251122


def probe_tokens(vocab_size: int, *, num_sequences: int = NUM_SEQUENCES, prompt_len: int = PROMPT_LEN,
                 continuation_len: int = CONTINUATION_LEN, seed: int = SEED) -> torch.Tensor:
    """[num_sequences, prompt_len + continuation_len] token ids in [1, vocab_size - 1), same on every rank."""
    if vocab_size < 3:
        raise ValueError(f"the probe needs a vocabulary of at least 3 tokens, got {vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    # Ids 0 and vocab_size-1 avoided: SGLang reports ids ≥ vocab_size-1 as 0 in input logprobs.
    return torch.randint(1, vocab_size - 1, (num_sequences, prompt_len + continuation_len), generator=gen)


def parse_continuation_logprobs(reply: Any, tokens: torch.Tensor, prompt_len: int, *, url: str) -> list[list[float]]:
    """The engine's logprob of every continuation token, checked against the ids that were sent."""
    rows = tokens.tolist()
    if not isinstance(reply, list) or len(reply) != len(rows):
        raise ValueError(f"probe: {url}/generate answered {type(reply).__name__} for a batch of {len(rows)}")
    out = []
    for i, (item, row) in enumerate(zip(reply, rows)):
        try:
            out.append(parse_input_logprobs(item, url=url, ids=row, start=prompt_len - 1))
        except MalformedReply as e:
            raise ValueError(f"probe: {url} sequence {i}: {e}") from e
    return out


def logprob_diffs(trainer_logprobs: torch.Tensor, engine_logprobs: Sequence[Sequence[float]],
                  prompt_len: int) -> tuple[float, float]:
    """(max, mean) |trainer − engine| over continuation tokens. `trainer_logprobs` is [B, S] with
    column t the logprob of token t given tokens < t (policy.compute_logprobs)."""
    trainer = trainer_logprobs[:, prompt_len:].double()
    engine = torch.tensor(engine_logprobs, dtype=torch.float64)
    diff = (trainer - engine).abs()
    return float(diff.max()), float(diff.mean())


async def engine_logprobs(url: str, tokens: torch.Tensor, prompt_len: int, *, api_key: Optional[str],
                          timeout_s: float, lora_name: Optional[str] = None) -> list[list[float]]:
    from megatron_flash.engines.client import EngineClient

    async with EngineClient(url, api_key=api_key, request_timeout_s=timeout_s) as client:
        client.lora_name = lora_name  # LoRA adapters pushed by name: score the one just pushed, not the base
        reply = await client.score(tokens.tolist(), logprob_start_len=prompt_len - 1)
    return parse_continuation_logprobs(reply, tokens, prompt_len, url=url)


def run_probe(policy: Any, urls: Sequence[str], *, api_key: Optional[str], timeout_s: float,
              rank0: bool, lora_name: Optional[str] = None, trial: Sequence[str] = (),
              threshold: float = float("inf")) -> Any:
    """Trainer (every rank, collective) vs every engine in `urls` (rank 0 asks them). On rank 0:
    (max, mean, worst url, {url: error} of engines that could not answer), or a message (str) when
    the probe could not run at all; None on other ranks. The caller broadcasts the result.
    Engines in `trial` (joining the fleet) that miss `threshold` are among those that could not
    answer, with the numbers, instead of failing the probe: a wrong engine is refused, the run goes on."""
    from megatron_flash.types import TrainBatch

    tokens = probe_tokens(policy.spec.vocab_size)
    # Random sequences no engine generated: a MoE trainer routes them itself (the engine too).
    trainer, _ = policy.compute_logprobs(TrainBatch(tokens=tokens, loss_mask=torch.zeros(tokens.shape)),
                                         own_routing=True)
    if not rank0:
        return None
    if not torch.isfinite(trainer[:, PROMPT_LEN:]).all():
        return ("post-sync probe: the trainer's own weights give non-finite logprobs (NaN/inf logits) on fixed "
                "token sequences: the last optimizer step blew them up (learning rate too high? a bad batch?); "
                "the run stops rather than train on or sample from them")

    async def every() -> list[Any]:
        return await asyncio.gather(*(engine_logprobs(u, tokens, PROMPT_LEN, api_key=api_key, timeout_s=timeout_s,
                                                      lora_name=lora_name) for u in urls), return_exceptions=True)
    try:
        worst, lost = (-1.0, -1.0, ""), {}
        for url, out in zip(urls, asyncio.run(every())):
            if isinstance(out, Exception):  # e.g. the engine died after its sync
                lost[url] = f"{type(out).__name__}: {out}"
                continue
            if isinstance(out, BaseException):
                raise out
            mx, mean = logprob_diffs(trainer, out, PROMPT_LEN)
            if url in trial and not mean <= threshold:
                lost[url] = (f"post-sync probe: mean |Δ logprob| {mean:.4g} (max {mx:.4g}) > probe_threshold "
                             f"{threshold:g}: it does not serve the trainer's weights (another model?)")
                continue
            worst = max(worst, (mean, mx, url))
        if lost and set(lost) <= set(trial) and worst[2] == "":  # only joining engines, all refused
            return float("nan"), float("nan"), "", lost
        if len(lost) == len(urls):
            return "post-sync probe could not run: no engine answered: " + "; ".join(f"{u}: {m}" for u, m in lost.items())
        return worst[1], worst[0], worst[2], lost
    except Exception as error:
        return f"post-sync probe could not run: {type(error).__name__}: {error}"
