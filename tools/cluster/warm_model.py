"""The quickstart's tiny model, warmed up on the sort4 answer format only, for runs on the mini-cluster.

    python tools/cluster/warm_model.py --out .cache/cluster-model     # -> .cache/cluster-model/warm_model

The same stages 1-3 as `make quickstart` (launch/quickstart_cpu.py: tools/make_tiny_model.py, the
format-only Megatron SFT, the HF export), without the RL run: the cluster's jobs do that part. An
existing warm_model is kept (delete the folder to rebuild it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "launch"))

from quickstart_common import Quickstart  # noqa: E402
from quickstart_cpu import format_only_samples  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, ".cache", "cluster-model"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    args = p.parse_args()
    run = Quickstart("cluster model", out=args.out)
    if os.path.isfile(os.path.join(run.warm_path, "config.json")):
        run.log(f"warm model at {run.warm_path} (kept)")
        return 0
    from megatron_flash.rewards.synthetic import get_task

    task = get_task("sort4")
    tokenizer = run.tiny_model(seed=args.seed)
    rng = random.Random(args.seed)
    run.warm_up(seed=args.seed, num_steps=args.sft_steps, batch_size=64,
                make_samples=lambda: format_only_samples(task, tokenizer, rng, 64),
                pad_id=tokenizer.pad_token_id, loss_label="nll/token", log_every=100)
    run.log(f"warm model at {run.warm_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
