"""Train time per step with π_prox recomputed (an extra forward) vs taken from the training forward.

    python benchmarks/prox_cost.py --model-path runs/smollm2 [--batch 32 --prompt-len 38 --response-len 48]
    python benchmarks/prox_cost.py --model-path runs/bench_models/sort4_quickstart_s0/warm_model --batch 128 \\
        --prompt-len 6 --response-len 5

One MegatronPolicy, one batch (random tokens of the model's vocabulary: `--batch` samples of
`--prompt-len` + `--response-len` tokens, behaviour logprobs and advantages at random, token lags of
0–2 versions), decoupled_ppo through the product's loss adapter, and the two ways the controller
trains a step (controller/loop.py make_batch + train):

  recompute     policy.compute_logprobs(batch) (π_prox), then policy.train_step
  approximate   policy.train_step alone, π_prox from its own forward (loss.prox_logprobs=approximate)

alternated for `--rounds` rounds of `--steps` steps each (side by side: the machine's drift hits both
alike); one optimizer step per batch, so `approximate` is exact here. Prints the median seconds per
step of each and the time saved; the last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=38)
    p.add_argument("--response-len", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import get_loss
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import TrainBatch

    policy = MegatronPolicy(PolicySettings(hf_path=args.model_path, micro_batch_size=args.micro_batch,
                                           optimizer=OptimizerConfig(lr=1e-9)))
    gen = torch.Generator().manual_seed(args.seed)
    b, width = args.batch, args.prompt_len + args.response_len
    tokens = torch.randint(1, policy.spec.vocab_size - 1, (b, width), generator=gen)
    mask = torch.zeros(b, width)
    mask[:, args.prompt_len:] = 1.0
    batch = TrainBatch(tokens=tokens, loss_mask=mask, lengths=torch.full((b,), width),
                       behavior_logprobs=-torch.rand(b, width, generator=gen) * 3 * mask,
                       advantages=torch.randn(b, 1, generator=gen).expand(b, width) * mask)
    lags = torch.randint(0, 3, (b, 1), generator=gen).float().expand(b, width) * mask
    loss = get_loss("decoupled_ppo")
    recompute_fn, approx_fn = make_loss_fn(loss), make_loss_fn(loss, approximate_prox=True)

    def recompute() -> None:
        prox = policy.compute_logprobs(batch)[0] * batch.loss_mask
        policy.train_step(batch.replace(proximal_logprobs=prox), recompute_fn)

    def approximate() -> None:
        approx_fn.theta_advance = 0.0
        policy.train_step(batch.replace(behavior_lag=lags), approx_fn)

    ways = {"recompute": recompute, "approximate": approximate}
    for fn in ways.values():
        fn()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ways[name]()
            seconds[name].append((time.perf_counter() - t0) / args.steps)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    saved = 1 - med["approximate"] / med["recompute"]
    for name, v in seconds.items():
        print(f"{name:12s} s/step per round: {', '.join(f'{x:.3f}' for x in v)} (median {med[name]:.3f})",
              file=sys.stderr)
    print(json.dumps({"model": args.model_path, "batch": b, "tokens_per_sample": width,
                      "s_per_step": {k: round(v, 4) for k, v in med.items()},
                      "rounds": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
                      "train_time_saved": round(saved, 3)}))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
