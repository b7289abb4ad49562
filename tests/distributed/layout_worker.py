"""Run under torchrun (or plain python for 1×1) by test_layouts.py: one layout's numbers to disk.

Writes into --out: logprobs.pt (fixed batch, before any step), export0/ (HF export right after
load), export1/ (HF export after one optimizer step on a fixed loss), metrics.json.

`--cases FILE` (case name → arguments, each with its own --out) runs several cases one after the
other in this one launch (grouped_cases.run_layout_cases): each builds a fresh policy, and its files
are bit for bit those of a launch of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from megatron_flash.trainer.lora import LoraOptions  # noqa: E402
from megatron_flash.trainer.model_builder import MoEOptions, ScaleOptions  # noqa: E402
from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings  # noqa: E402
from megatron_flash.types import TrainBatch  # noqa: E402
from tests.distributed.grouped_cases import read_cases  # noqa: E402


def fixed_batch(vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, vocab, (8, 16), generator=gen)
    mask = torch.zeros(8, 16)
    lengths = torch.tensor([6, 16, 7, 11, 8, 13, 9, 12])  # a 4-token prompt + responses of 2..12
    for i, n in enumerate(lengths.tolist()):
        mask[i, 4:n] = 1.0
    weights = torch.randn(8, 16, generator=gen)
    # the fixed loss's per-token weights travel as `advantages` (weighted_nll reads them there)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=weights)


GROUPS = ((6, (4, 9, 2, 7)), (3, (5,)), (8, (3, 6, 1)))
"""grouped_batch: (prompt length, response lengths) per group: mixed lengths, a group of one, and a
group of 34 tokens that a 24-token budget splits."""


def grouped_batch(vocab: int) -> TrainBatch:
    """8 samples in 3 groups; the samples of a group share their prompt tokens (shared-prefix tests)."""
    gen = torch.Generator().manual_seed(321)
    rows, lengths, prompts, groups = [], [], [], []
    for g, (prompt_len, responses) in enumerate(GROUPS):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        for r in responses:
            rows.append(torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]))
            lengths.append(prompt_len + r)
            prompts.append(prompt_len)
            groups.append(g)
    tokens = torch.zeros(len(rows), 16, dtype=torch.long)
    mask = torch.zeros(len(rows), 16)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
        mask[i, prompts[i]:lengths[i]] = 1.0
    return TrainBatch(tokens=tokens, lengths=torch.tensor(lengths), loss_mask=mask,
                      advantages=torch.randn(len(rows), 16, generator=gen), group_ids=torch.tensor(groups),
                      prompt_lengths=torch.tensor(prompts))


def weighted_nll(mb: TrainBatch, logprobs: torch.Tensor, entropy: object):
    mask = mb.loss_mask
    return -(mb.advantages * logprobs * mask).sum(), mask.sum(), {}


def rl_fields(batch: TrainBatch, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """An off-policy RL batch: behavior logprobs = current ones perturbed, ± rewards, per-sequence A."""
    gen = torch.Generator().manual_seed(7)
    mask = batch.loss_mask
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    adv = torch.randn(8, generator=gen)
    return {
        "behavior_logprobs": (logprobs + 0.3 * torch.randn(logprobs.shape, generator=gen)) * mask,
        "proximal_logprobs": logprobs * mask,
        "advantages": adv[:, None] * mask,
        "rewards": rewards,
    }


def teacher_topk(batch: TrainBatch, vocab: int, k: int) -> dict[str, torch.Tensor]:
    """A teacher's top-k per position: the k most likely ids of a random distribution and their
    logprobs (0 off the trained tokens, as the controller lays them out)."""
    gen = torch.Generator().manual_seed(11)
    b, s = batch.tokens.shape
    lps, ids = torch.log_softmax(torch.randn(b, s, vocab, generator=gen) * 2, dim=-1).topk(k, dim=-1)
    keep = (batch.loss_mask != 0)[..., None]
    return {"teacher_topk_ids": ids * keep, "teacher_topk_logprobs": lps * keep}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--loss", default="", help="registry loss (e.g. tis); default: fixed weighted NLL")
    p.add_argument("--aggregation", default="token_mean")
    p.add_argument("--aggregation-norm", type=float, default=None, help="C of seq_mean_token_sum_norm")
    p.add_argument("--loss-param", action="append", default=[], help="key=value for the loss")
    p.add_argument("--no-pack", action="store_true", help="padded micro-batches (trainer.pack_sequences=false)")
    p.add_argument("--max-tokens", type=int, default=0, help="trainer.max_tokens_per_micro_batch")
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--dtype", default="float32", help="model.dtype")
    p.add_argument("--attention-backend", default="auto", help="model.attention_backend (flash: CUDA)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    p.add_argument("--moe-aux", type=float, default=None, help="MoE load-balancing loss coefficient")
    p.add_argument("--recompute", default="none")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--distill-topk", type=int, default=0, help="a teacher top-k reverse KL term (with --loss)")
    p.add_argument("--distill-coef", type=float, default=1.0)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (base frozen)")
    p.add_argument("--lora-targets", default="qkv,proj,fc1,fc2")
    p.add_argument("--lora-b-std", type=float, default=0.0, help="B ~ N(0, std) instead of zeros (A then moves too)")
    p.add_argument("--lora-adapter", default="", help="start from this PEFT adapter (model.lora.adapter_path)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="model.lora.dropout")
    p.add_argument("--record-dropout", action="store_true",
                   help="save every dropout mask (p > 0) of the training steps to dropout_rank<r>.pt, in call order")
    p.add_argument("--recast-cu-seqlens", action="store_true",
                   help="every packed row's cu_seqlens replaced by a cast copy (int64 and back), as Megatron may")
    p.add_argument("--reimport-unused", action="store_true",
                   help="also load export0/adapter plus one tensor no module takes; the error to unused.txt")
    p.add_argument("--grouped", action="store_true", help="the grouped batch (prompts shared within groups)")
    p.add_argument("--shared-prefix", action="store_true", help="trainer.shared_prefix")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps on the batch before export1")
    p.add_argument("--reimport", action="store_true",
                   help="also build a policy from export0/adapter and export its adapter to reimport0/")
    return p


def lora_options(args: argparse.Namespace, adapter_path: str = "") -> LoraOptions:
    return LoraOptions(rank=args.lora_rank, targets=tuple(args.lora_targets.split(",")), b_std=args.lora_b_std,
                       adapter_path=adapter_path or args.lora_adapter, dropout=args.lora_dropout)


def build(args: argparse.Namespace, adapter_path: str = "") -> MegatronPolicy:
    return MegatronPolicy(PolicySettings(
        hf_path=args.hf_dir, tp_size=args.tp, pp_size=args.pp, micro_batch_size=args.micro_batch_size,
        dtype=args.dtype, attention_backend=args.attention_backend,
        pack_sequences=not args.no_pack, max_tokens_per_micro_batch=args.max_tokens, shared_prefix=args.shared_prefix,
        scale=ScaleOptions(sequence_parallel=args.sp, virtual_pipeline_size=args.vpp, recompute=args.recompute,
                           context_parallel_size=args.cp,
                           recompute_num_layers=1),
        moe=MoEOptions(ep_size=args.ep, aux_loss_coeff=args.moe_aux),
        optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr, clip_grad=1e6, adam_eps=args.adam_eps,
                                  use_distributed_optimizer=args.distributed_optimizer),
        lora=lora_options(args, adapter_path),
    ))


def reimport_with_an_unused_tensor(args: argparse.Namespace, adapter_dir: str) -> None:
    """A copy of the adapter with one extra tensor that no module of the model takes: building a policy
    from it must fail by name (on every rank, also under pipeline parallelism)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_flash.hf.spec import CheckpointError

    copy = os.path.join(args.out, "adapter_unused")
    if dist.get_rank() == 0:
        shutil.copytree(adapter_dir, copy)
        tensors = load_file(os.path.join(copy, "adapter_model.safetensors"))
        tensors["base_model.model.model.layers.99.self_attn.o_proj.lora_A.weight"] = torch.zeros(2, 2)
        save_file(tensors, os.path.join(copy, "adapter_model.safetensors"))
    dist.barrier()
    try:
        build(args, adapter_path=copy)
        message = "(no error)"
    except CheckpointError as err:
        message = str(err)
    with open(os.path.join(args.out, f"unused_rank{dist.get_rank()}.txt"), "w") as f:
        f.write(message)


@contextlib.contextmanager
def recast_cu_seqlens(on: bool):
    """Rows whose cu_seqlens are copies of what the micro-batch built: whatever rode on the original
    tensor would be lost; what the trainer passes explicitly is not."""
    from megatron_flash.trainer import micro_batches

    made = micro_batches.packed_seq_params

    def recast(segments, device):
        params = made(segments, device)
        params.cu_seqlens_q = params.cu_seqlens_q.to(torch.int64).to(params.cu_seqlens_q.dtype)
        params.cu_seqlens_kv = params.cu_seqlens_q.clone()
        return params
    if on:
        micro_batches.packed_seq_params = recast
    try:
        yield
    finally:
        micro_batches.packed_seq_params = made


def run_case(args: argparse.Namespace) -> None:
    with recast_cu_seqlens(args.recast_cu_seqlens):
        _run_case(args)


def _run_case(args: argparse.Namespace) -> None:
    policy = build(args)
    batch = (grouped_batch if args.grouped else fixed_batch)(policy.spec.vocab_size)
    logprobs, _ = policy.compute_logprobs(batch)
    policy.export_hf(os.path.join(args.out, "export0"))
    if args.reimport:  # export → import → export of the adapters
        again = build(args, adapter_path=os.path.join(args.out, "export0", "adapter"))
        again.export_adapter(os.path.join(args.out, "reimport0"))
        del again
    if args.reimport_unused:
        reimport_with_an_unused_tensor(args, os.path.join(args.out, "export0", "adapter"))
    recorded: list[torch.Tensor] = []
    if args.record_dropout:  # every mask the adapters draw in the training steps (LoRA dropout's only user)
        plain = torch.nn.functional.dropout

        def recording(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
            out = plain(x, p=p, training=training, inplace=inplace)
            if p > 0 and training:  # Megatron's own attention / hidden dropout calls run at p = 0 here
                recorded.append(out.detach() != 0)
            return out
        torch.nn.functional.dropout = recording
    loss_fn = weighted_nll
    if args.loss:
        from megatron_flash.losses import get_loss
        from megatron_flash.trainer.loss_adapter import make_loss_fn

        params = {}
        for kv in args.loss_param:
            key, value = kv.split("=", 1)
            try:
                params[key] = float(value)
            except ValueError:
                params[key] = value
        distill = (args.distill_coef, "add") if args.distill_topk else None
        loss_fn = make_loss_fn(get_loss(args.loss, **params), aggregation=args.aggregation,
                               norm=args.aggregation_norm, distill=distill)
        batch = batch.replace(**rl_fields(batch, logprobs))
        if args.distill_topk:
            batch = batch.replace(**teacher_topk(batch, policy.spec.vocab_size, args.distill_topk))
    losses = []
    for _ in range(args.steps):
        metrics = policy.train_step(batch, loss_fn)
        losses.append(metrics["loss"])
    metrics["losses"] = losses
    # the tokens this rank's layers run on (under context parallelism: its share of every row)
    tokens_computed = sum(int(m.tokens.numel()) for m in policy._micro_batches(batch))
    if args.record_dropout:
        torch.nn.functional.dropout = plain
        torch.save(recorded, os.path.join(args.out, f"dropout_rank{dist.get_rank()}.pt"))
    policy.export_hf(os.path.join(args.out, "export1"))
    if dist.get_rank() == 0:
        torch.save(logprobs, os.path.join(args.out, "logprobs.pt"))
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({**metrics, "dp": policy.layout.dp_size, "tokens_computed": tokens_computed}, f)


def main() -> None:
    for name, argv in read_cases(sys.argv[1:]).items():
        try:
            run_case(parser().parse_args(argv))
        except BaseException:
            print(f"layout_worker: case {name!r} failed: {' '.join(argv)}", file=sys.stderr, flush=True)
            raise
        gc.collect()  # the previous case's model, gradients and optimizer state
    destroy_distributed()


if __name__ == "__main__":
    main()
