"""Peak extra memory and time of the logprob step: chunked (the trainer's) vs the whole-tensor reference.

    python benchmarks/logprob_memory.py --device cuda                        # 16k tokens × 152k vocabulary, bf16
    python benchmarks/logprob_memory.py --tokens 512 --vocab 4096             # CPU smoke (no memory figure)

One row of `--tokens` tokens with bf16 logits over `--vocab` columns (they, and the gradient the
backward must return, are the step's inputs and outputs: counted apart), logprobs and entropy, a
weighted sum backward. "Extra" is the CUDA peak allocated during forward + backward minus what was
allocated before (the logits) and minus the gradient's own size. Last line, one JSON object:
extra_gb_chunked, extra_gb_reference (null when it does not fit: out of memory), seconds_chunked,
seconds_reference, max_abs_diff (logprobs, chunked vs reference, when both ran).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=152064)
    args = p.parse_args(argv)
    import torch

    from megatron_flash.trainer.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_reference

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(1, args.tokens, args.vocab, device=dev, dtype=dtype, generator=gen).requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=dev, generator=gen)
    grad_bytes = logits.numel() * logits.element_size()
    out: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "tokens": args.tokens,
                 "vocab": args.vocab, "logits_gb": grad_bytes / 1e9}
    for fn in (vocab_parallel_logprobs, vocab_parallel_logprobs_reference):  # first-call costs, off the clock
        small = logits.detach()[:, :8].clone().requires_grad_()
        lp, ent = fn(small, targets[:, :8], vocab_size=args.vocab, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        del small, lp, ent
    values = {}
    for name, fn in (("chunked", vocab_parallel_logprobs), ("reference", vocab_parallel_logprobs_reference)):
        logits.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        try:
            t0 = time.perf_counter()
            lp, ent = fn(logits, targets, vocab_size=args.vocab, with_entropy=True)
            (lp.sum() + 0.01 * ent.sum()).backward()
            if cuda:
                torch.cuda.synchronize()
            out[f"seconds_{name}"] = time.perf_counter() - t0
            values[name] = lp.detach().float()
            out[f"extra_gb_{name}"] = ((torch.cuda.max_memory_allocated(dev) - base - grad_bytes) / 1e9
                                       if cuda else None)
        except torch.OutOfMemoryError:
            out[f"extra_gb_{name}"], out[f"seconds_{name}"] = None, None
        del logits.grad
        logits.grad = None
        if cuda:
            torch.cuda.empty_cache()
    if len(values) == 2:
        out["max_abs_diff"] = float((values["chunked"] - values["reference"]).abs().max())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
