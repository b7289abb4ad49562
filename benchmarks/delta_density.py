"""How many bf16 weight values change per Adam step: the density a delta weight push would carry.

    OMP_NUM_THREADS=1 python benchmarks/delta_density.py --hf-dir runs/smollm2 --lrs 1e-6,1e-5,1e-4 --steps 20
    OMP_NUM_THREADS=1 python benchmarks/delta_density.py --hf-dir runs/smollm2 --lrs 1e-5 --steps 5 --batch 2

For every learning rate a fresh MegatronPolicy (TP1, fp32 weights; Adam, constant LR, no warm-up, the
other optimizer fields at OptimizerConfig's defaults) takes --steps optimizer steps, each on a new
seeded batch of random token ids [--batch, --seq-len] whose second half trains, weighted by
random-normal "advantages" (a fixed weighted NLL: the shape of a policy-gradient step). The engine
holds bf16: after every step each model parameter is cast to bf16 and compared bit for bit (as int16)
with its bf16 cast from before the step. One JSON line per (lr, step):

  density        changed bf16 values / all values, over the whole model
  dense_tensors  parameters (Megatron's tensors: fused QKV, fused gate/up) with density > 0.5
  changed/total  changed and all values
  compare_s      seconds to cast to bf16, compare and count (every tensor; the kept copy then replaced)
  bytes_full     the full bf16 push: total · 2
  bytes_pos_val  positions as int32 + new bf16 values: changed · (4 + 2)
  bytes_zlib     per tensor, the gaps between changed positions (int32, the first one absolute),
                 all tensors' streams zlib level 1 as one, + changed · 2 bytes of values
  bytes_bitmask  a bitmask of changed positions (total / 8) + changed · 2 bytes of values
  encode_s       seconds to build the zlib stream; loss, step_s: the training step
  wire_bytes     what the product's encoder (weight_sync/delta.py, as the bridge runs it: the HF tensors
                 in 512 MiB buckets, delta mode against the kept bf16 copy) puts on the wire: positions or
                 bitmask, values, whole dense tensors, per-tensor checksums
  wire_bytes_full  the same HF tensors whole in bf16 (HF names: no vocabulary padding, tied weights once)
  wire_encode_s  its time: cast, compare, gather, update the copy, checksums (one thread)

First a setup line (the optimizer config used, the optimizer's class, whether it steps the model's
own parameters), then per lr one summary line: density mean/min/max over the steps, the mean ratios
of each encoding to bytes_full, compare seconds per GB of bf16 weights (mean compare_s / GB; the
median compare_s beside it), the kept copy's GB, and the names of the tensors dense at any step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import warnings
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_flash.config.schema import OptimizerConfig  # noqa: E402
from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from megatron_flash.types import TrainBatch  # noqa: E402
from megatron_flash.weight_sync.delta import DeltaEncoder  # noqa: E402
from megatron_flash.weight_sync.plan import hf_buckets  # noqa: E402


def weighted_nll(mb: TrainBatch, logprobs: torch.Tensor, entropy: object):
    mask = mb.loss_mask
    return -(mb.advantages * logprobs * mask).sum(), mask.sum(), {}


def make_batch(vocab: int, rows: int, seq_len: int, seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    mask = torch.zeros(rows, seq_len)
    mask[:, seq_len // 2:] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=torch.randn(rows, seq_len, generator=gen))


def bf16_bits(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to(torch.bfloat16).view(torch.int16) for p in params]


def compare(params: list[torch.Tensor], kept: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the new bf16 copy, each tensor's flat bool mask of changed values)."""
    new = bf16_bits(params)
    return new, [(a != b).reshape(-1) for a, b in zip(new, kept)]


def zlib_positions(masks: list[torch.Tensor]) -> int:
    chunks = []
    for m in masks:
        idx = m.nonzero().reshape(-1)
        if idx.numel():
            chunks.append(torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32).numpy().tobytes())
    return len(zlib.compress(b"".join(chunks), 1))


def push(policy: MegatronPolicy, encoder: DeltaEncoder, mode: str, version: int) -> tuple[int, float, int]:
    """The product's encoding of one push (as the bridge's sender runs it): wire bytes, seconds, whole bytes."""
    encoder.start_pass()
    wire = 0
    for bucket in hf_buckets(policy, bucket_bytes=512 * 2**20, copy=False):
        wire += sum(t.numel() * t.element_size() for _, t in encoder.encode(bucket, mode, base=encoder.base_version))
    encoder.commit(version)
    return wire, encoder.stats.seconds, encoder.stats.bytes_full


def run_lr(args: argparse.Namespace, lr: float) -> dict:
    opt = OptimizerConfig(name="adam", lr=lr, clip_grad=1.0, lr_warmup_steps=0, lr_decay_style="constant")
    policy = MegatronPolicy(PolicySettings(hf_path=args.hf_dir, micro_batch_size=args.batch,
                                           optimizer_steps=args.steps, optimizer=opt))
    named = [(n, p) for chunk in policy.chunks for n, p in chunk.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    stepped = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    total = sum(p.numel() for p in params)
    print(json.dumps({"setup": True, "lr": lr, "optimizer": dataclasses.asdict(opt),
                      "optimizer_class": type(policy.optimizer).__name__,
                      "param_dtypes": sorted({str(p.dtype) for p in params}),
                      "steps_model_params": all(id(p) in stepped for p in params),
                      "tensors": len(params), "total": total, "batch": [args.batch, args.seq_len]}), flush=True)
    kept = bf16_bits(params)
    encoder = DeltaEncoder(torch.bfloat16)

    push(policy, encoder, "full", 0)  # the first push: the kept copy
    rows, dense_names = [], set()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        metrics = policy.train_step(make_batch(policy.spec.vocab_size, args.batch, args.seq_len, step), weighted_nll)
        step_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        new, masks = compare(params, kept)
        counts = [int(m.sum()) for m in masks]
        compare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        zbytes = zlib_positions(masks)
        encode_s = time.perf_counter() - t0
        wire, wire_s, wire_full = push(policy, encoder, "delta", step)
        kept = new
        changed = sum(counts)
        dense_names.update(n for (n, _), c, m in zip(named, counts, masks) if c > 0.5 * m.numel())
        row = {"lr": lr, "step": step, "density": changed / total,
               "dense_tensors": sum(c > 0.5 * m.numel() for c, m in zip(counts, masks)),
               "changed": changed, "total": total, "compare_s": round(compare_s, 4),
               "bytes_full": 2 * total, "bytes_pos_val": 6 * changed, "bytes_zlib": zbytes + 2 * changed,
               "bytes_bitmask": (total + 7) // 8 + 2 * changed, "encode_s": round(encode_s, 4),
               "wire_bytes": wire, "wire_bytes_full": wire_full, "wire_encode_s": round(wire_s, 4),
               "loss": metrics["loss"], "step_s": round(step_s, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    copy_gb = encoder.copy_bytes() / 1e9
    del policy, named, params, kept, new, masks, encoder
    gc.collect()
    full = rows[0]["bytes_full"]
    dens = [r["density"] for r in rows]

    def ratio(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows) / full

    return {"summary": True, "lr": lr, "steps": len(rows), "density_mean": sum(dens) / len(dens),
            "density_min": min(dens), "density_max": max(dens),
            "dense_tensors_max": max(r["dense_tensors"] for r in rows),
            "ratio_pos_val_mean": ratio("bytes_pos_val"), "ratio_zlib_mean": ratio("bytes_zlib"),
            "ratio_bitmask_mean": ratio("bytes_bitmask"),
            "compare_s_per_gb": sum(r["compare_s"] for r in rows) / len(rows) / (full / 1e9),
            "compare_s_median": sorted(r["compare_s"] for r in rows)[len(rows) // 2],
            "encode_s_mean": sum(r["encode_s"] for r in rows) / len(rows),
            "kept_copy_gb": full / 1e9, "encoder_copy_gb": copy_gb,
            "ratio_wire_mean": sum(r["wire_bytes"] / r["wire_bytes_full"] for r in rows) / len(rows),
            "wire_encode_s_per_gb": sum(r["wire_encode_s"] for r in rows) / len(rows) / (rows[0]["wire_bytes_full"] / 1e9),
            "wire_encode_share_of_step": sum(r["wire_encode_s"] for r in rows) / sum(r["step_s"] for r in rows),
            "step_s_mean": sum(r["step_s"] for r in rows) / len(rows),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "dense_tensor_names": sorted(dense_names)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="comma-separated learning rates, a fresh policy each")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    for lr in args.lrs.split(","):
        print(json.dumps(run_lr(args, float(lr))), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
