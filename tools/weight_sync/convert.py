"""Convert between HF safetensors and a Megatron-Core distributed checkpoint, at any TP × PP (× EP).

    python tools/weight_sync/convert.py hf-to-mcore --hf runs/tiny_model --out runs/tiny_mcore
    torchrun --nproc-per-node 2 tools/weight_sync/convert.py hf-to-mcore --hf DIR --out CKPT --tp 2
    python tools/weight_sync/convert.py mcore-to-hf --ckpt CKPT --out HF_OUT
    torchrun --nproc-per-node 2 tools/weight_sync/convert.py mcore-to-hf --ckpt CKPT --out HF_OUT --pp 2 \\
        --hf-config DIR            # config.json / tokenizer from DIR instead of the copy inside CKPT
    torchrun --nproc-per-node 2 tools/weight_sync/convert.py hf-to-mcore --hf MOE_DIR --out CKPT --ep 2
                                   # MoE: experts split over 2 expert-parallel ranks (TP > 1 adds sequence parallel)

hf-to-mcore builds this rank's Megatron stage (the same builder and HF reader as the trainer's
policy, without DDP or optimizer), reads its shard from the HF safetensors and saves
`stage.sharded_state_dict()` with `megatron.core.dist_checkpointing` (torch_dist format). CKPT then
also holds `mf_convert.json` (source, dtype, layout it was written with, padded vocabulary) and
`hf_config/` (the source's config.json and tokenizer files), so it converts back on its own.

A distributed checkpoint stores global tensors, so mcore-to-hf may use any TP × PP: each rank loads
only its shard. One thing does depend on TP: Megatron pads the vocabulary to a multiple of
`divisible_by × TP`; the loader keeps the checkpoint's padded size (it sets divisible_by to
padded / TP), and the HF export strips the padding again.

Both directions write into `OUT.partial` and rename it into place when complete, so a failure
leaves no half-written output. Runs on CPU (gloo) and GPU (NCCL) alike. megatron-core's checkpoint
writer needs `psutil`. Prints one JSON object as its last stdout line; exit 0 on success, 2 on a
usage/input error (the message names the path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

META_FILE = "mf_convert.json"
HF_CONFIG_DIR = "hf_config"
EMBEDDING_KEY = "embedding.word_embeddings.weight"


class ConvertError(ValueError):
    """A missing or unusable input; the message names the path."""


# ---------------------------------------------------------------------- input checks (before any rank starts)
def check_hf_dir(path: str, *, need_weights: bool) -> None:
    if not os.path.isdir(path):
        raise ConvertError(f"HF directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConvertError(f"HF directory {path!r} has no config.json")
    if need_weights and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ConvertError(f"HF directory {path!r} has no *.safetensors weights")


def check_ckpt_dir(path: str) -> dict[str, Any]:
    """The checkpoint's mf_convert.json ({} for a checkpoint written by other tools)."""
    if not os.path.isdir(path):
        raise ConvertError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ConvertError(f"{path!r} is not a Megatron distributed checkpoint (no metadata.json)")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        return {}
    with open(meta_path) as f:
        return json.load(f)


def check_out(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConvertError(f"parent directory of --out {path!r} does not exist")


# ---------------------------------------------------------------------- model stage
def build_stage(hf_dir: str, *, tp: int, pp: int, dtype: str, divisible_by: int,
                ep: int = 1) -> tuple[Any, Any, Any, int]:
    """(stage, spec, layout, padded_vocab) for this rank; parameters hold Megatron's init."""
    from megatron_flash.trainer.distributed import init_distributed
    from megatron_flash.trainer.model_builder import (
        MoEOptions,
        ScaleOptions,
        build_gpt_stage,
        padded_vocab_size,
        transformer_config,
        validate_layout,
    )
    from megatron_flash.hf.spec import read_hf_spec

    spec = read_hf_spec(hf_dir)
    moe = MoEOptions(ep_size=ep)
    # Megatron's MoE layer needs sequence parallel under TP; it changes no weight.
    scale = ScaleOptions(sequence_parallel=spec.moe is not None and tp > 1)
    validate_layout(spec, tp_size=tp, pp_size=pp, moe=moe, sequence_parallel=scale.sequence_parallel)
    layout = init_distributed(tp_size=tp, pp_size=pp, seed=0, ep_size=ep)
    config = transformer_config(spec, tp_size=tp, pp_size=pp, dtype=dtype, scale=scale, moe=moe)
    stage = build_gpt_stage(spec, config=config, make_vocab_size_divisible_by=divisible_by)
    return stage, spec, layout, padded_vocab_size(spec.vocab_size, divisible_by=divisible_by, tp_size=tp)


def save_dist_checkpoint(sharded_state_dict: dict, path: str) -> None:
    """Megatron torch_dist save that also works on a CPU-only torch (megatron_flash.trainer.checkpoint)."""
    from megatron_flash.trainer.patches.async_save import save_dist_checkpoint as save

    save(sharded_state_dict, path)


def hf_to_mcore(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_flash.hf.io import TOKENIZER_FILES, load_hf_weights, replace_dir

    check_hf_dir(args.hf, need_weights=True)
    check_out(args.out)
    try:
        import psutil  # noqa: F401
    except ImportError:  # without it megatron's writer processes die and the save waits forever
        raise ConvertError("megatron-core's checkpoint writer needs psutil: pip install psutil") from None
    stage, spec, layout, padded = build_stage(args.hf, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                              divisible_by=args.divisible_by, ep=args.ep)
    load_hf_weights(stage, args.hf, spec=spec, layout=layout, padded_vocab_size=padded)

    out = os.path.abspath(args.out)
    partial = out + ".partial"
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)  # empty: Megatron warns about a non-empty target
    dist.barrier()
    try:
        save_dist_checkpoint(stage.sharded_state_dict(), partial)
        if layout.rank == 0:
            os.makedirs(os.path.join(partial, HF_CONFIG_DIR))
            for name in ("config.json",) + TOKENIZER_FILES:
                src = os.path.join(args.hf, name)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(partial, HF_CONFIG_DIR, name))
            meta = {"format": "megatron-core dist_checkpointing (torch_dist)", "source": os.path.abspath(args.hf),
                    "hf_config": HF_CONFIG_DIR, "dtype": args.dtype, "family": spec.family,
                    "saved_with": {"tp": args.tp, "pp": args.pp, "ep": args.ep}, "padded_vocab_size": padded,
                    "vocab_size": spec.vocab_size}
            with open(os.path.join(partial, META_FILE), "w") as f:
                json.dump(meta, f, indent=2)
            replace_dir(partial, out)
    except BaseException:
        if layout.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    dist.barrier()
    return {"command": "hf-to-mcore", "out": out, "tp": args.tp, "pp": args.pp, "ep": args.ep, "dtype": args.dtype,
            "padded_vocab_size": padded}


def mcore_to_hf(args: argparse.Namespace) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from megatron_flash.hf.io import export_hf
    from megatron_flash.trainer.model_builder import DTYPES

    meta = check_ckpt_dir(args.ckpt)
    hf_config = args.hf_config or os.path.join(args.ckpt, meta.get("hf_config", HF_CONFIG_DIR))
    if not args.hf_config and not os.path.isdir(hf_config):
        raise ConvertError(f"checkpoint {args.ckpt!r} has no {HF_CONFIG_DIR}/ copy of the HF config; pass --hf-config DIR")
    check_hf_dir(hf_config, need_weights=False)
    check_out(args.out)
    dtype = args.dtype or meta.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")

    # Keep the checkpoint's padded vocabulary whatever TP we load with (see the module docstring).
    shapes = dist_checkpointing.load_tensors_metadata(args.ckpt)
    if EMBEDDING_KEY not in shapes:
        raise ConvertError(f"checkpoint {args.ckpt!r} has no tensor {EMBEDDING_KEY!r}: not a GPT model checkpoint")
    padded = int(shapes[EMBEDDING_KEY].global_shape[0])
    if padded % args.tp:
        raise ConvertError(f"checkpoint vocabulary (padded to {padded}) cannot be split over --tp {args.tp}")
    stage, spec, layout, got = build_stage(hf_config, tp=args.tp, pp=args.pp, dtype=dtype,
                                           divisible_by=padded // args.tp, ep=args.ep)
    assert got == padded, (got, padded)

    loaded = dist_checkpointing.load(stage.sharded_state_dict(), args.ckpt)
    stage.load_state_dict(loaded, strict=True)
    export_hf(stage, args.out, spec=spec, layout=layout, source_dir=hf_config, dtype=DTYPES[dtype])
    return {"command": "mcore-to-hf", "out": os.path.abspath(args.out), "tp": args.tp, "pp": args.pp, "ep": args.ep,
            "dtype": dtype, "padded_vocab_size": padded}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors → Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json, *.safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to write (replaced if it exists)")
    a.add_argument("--dtype", default="float32", help="parameter dtype of the checkpoint")
    a.add_argument("--divisible-by", type=int, default=128, help="Megatron's make_vocab_size_divisible_by")
    b = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint → HF safetensors")
    b.add_argument("--ckpt", required=True, help="checkpoint directory written by hf-to-mcore (or Megatron)")
    b.add_argument("--out", required=True, help="HF directory to write (replaced if it exists)")
    b.add_argument("--hf-config", default="", help="directory with config.json/tokenizer (default: CKPT/hf_config)")
    b.add_argument("--dtype", default="", help="default: the checkpoint's (mf_convert.json), else float32")
    for q in (a, b):
        q.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world = tp × pp × dp; dp % ep == 0)")
        q.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
        q.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE checkpoints only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    t0 = time.perf_counter()
    try:
        result = (hf_to_mcore if args.command == "hf-to-mcore" else mcore_to_hf)(args)
    except ValueError as error:  # ConvertError, CheckpointError, layout errors: the user's input
        print(f"error: {error}", file=sys.stderr)
        if rank0:
            print(json.dumps({"command": args.command, "ok": False, "error": str(error)}))
        return 2
    finally:
        if "megatron.core" in sys.modules:  # an input error may stop us before torch.distributed starts
            from megatron_flash.trainer.distributed import destroy_distributed

            destroy_distributed()
    if rank0:
        print(json.dumps({**result, "ok": True, "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
