"""Check that a HF checkpoint loaded into Megatron-Core gives the same logits as transformers.

    python tools/check_parity.py --hf-dir runs/tiny_model                       # TP1 × PP1
    torchrun --nproc-per-node 4 tools/check_parity.py --hf-dir DIR --tp 2 --pp 2
    python tools/check_parity.py --hf-dir DIR --pack                            # packed samples
    torchrun --nproc-per-node 2 tools/check_parity.py --hf-dir MOE_DIR --ep 2      # experts split over 2 ranks
    torchrun --nproc-per-node 4 tools/check_parity.py --hf-dir MOE_DIR --tp 2 --sp --ep 2   # MoE with TP needs SP
    torchrun --nproc-per-node 2 tools/check_parity.py --hf-dir DIR --pp 2 --vpp 2   # interleaved

Loads the checkpoint into Megatron with the given layout and into transformers (on rank 0), runs
the same random batch through both, and prints as its last line one JSON object:
max_abs_logit_diff, max_abs_logprob_diff (log-softmax of each), and the layout. Exit code 0 when
both are within --tol (default 1e-4, for fp32), 1 otherwise.

Without --pack every row is one sample, padded micro-batches (trainer.pack_sequences=false). With
--pack the samples get random lengths (--seq-len / 4 … --seq-len) and are packed end to end into one
row (block-diagonal attention, positions restarting per sample); transformers runs each sample alone,
and every position of every sample is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--pack", action="store_true", help="samples of different lengths packed in one row")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    parser.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    return parser


def build_policy(args: argparse.Namespace) -> Any:
    """The Megatron policy of the checkpoint in the asked layout (initialises the process group)."""
    from megatron_flash.trainer.model_builder import MoEOptions, ScaleOptions
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings

    return MegatronPolicy(PolicySettings(hf_path=args.hf_dir, tp_size=args.tp, pp_size=args.pp,
                                         dtype=args.dtype, micro_batch_size=args.batch, pack_sequences=args.pack,
                                         scale=ScaleOptions(virtual_pipeline_size=args.vpp, sequence_parallel=args.sp),
                                         # forward only: the load-balancing loss plays no part
                                         moe=MoEOptions(ep_size=args.ep, etp_size=args.etp, aux_loss_coeff=0.0)
                                         if args.ep > 1 else MoEOptions(etp_size=args.etp)))


def compare(policy: Any, args: argparse.Namespace) -> Optional[dict]:
    """The comparison; rank 0 returns the JSON summary, other ranks None. Collective. The process
    group stays up (main tears it down), so a caller may run several checks in one launch."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, policy.spec.vocab_size, (args.batch, args.seq_len), generator=gen)
    lengths = torch.full((args.batch,), args.seq_len)
    if args.pack:
        lengths = torch.randint(max(2, args.seq_len // 4), args.seq_len + 1, (args.batch,), generator=gen)
    logits = policy.compute_logits(tokens, lengths).double()
    if dist.get_rank() != 0:
        return None
    import transformers

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype).to(device)
    logit_diff = lp_diff = 0.0
    for i, n in enumerate(lengths.tolist()):  # each sample alone through transformers
        with torch.no_grad():
            ref = hf(tokens[i:i + 1, :n].to(device)).logits[0].double().cpu()
        got = logits[i, :n]
        logit_diff = max(logit_diff, (got - ref).abs().max().item())
        lp_diff = max(lp_diff, (torch.log_softmax(got, -1) - torch.log_softmax(ref, -1)).abs().max().item())
    ok = logit_diff <= args.tol and lp_diff <= args.tol
    return {"hf_dir": args.hf_dir, "family": policy.spec.family, "tp": args.tp, "pp": args.pp,
            "vpp": args.vpp, "sp": args.sp, "ep": args.ep, "etp": args.etp, "pack": args.pack,
            "lengths": lengths.tolist(), "dtype": args.dtype,
            "max_abs_logit_diff": logit_diff, "max_abs_logprob_diff": lp_diff, "tol": args.tol, "ok": ok}


def main() -> int:
    args = arg_parser().parse_args()
    warnings.filterwarnings("ignore")
    from megatron_flash.hf.spec import CheckpointError
    from megatron_flash.trainer.distributed import destroy_distributed

    try:
        policy = build_policy(args)
    except (CheckpointError, ValueError) as e:
        print(f"check_parity: {e}", file=sys.stderr)
        return 2
    result = compare(policy, args)
    if result is not None:
        print(json.dumps(result))
    destroy_distributed()
    return 0 if result is None or result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
