"""Run checkpoints: Megatron distributed checkpoint + the rollout state, saved atomically, resumed exactly.

Layout under `checkpoint.save_dir`:

    step_000012/                       one complete checkpoint (renamed into place when whole)
        meta.json                      step, policy version, the layout it was saved with — written last
        trainer/                       Megatron-Core dist_checkpointing (torch_dist): model weights and
                                       optimizer state as sharded tensors in the canonical (unsharded)
                                       space, so any TP × PP × DP layout can load them
        rank_state/rank_00000.pt       per rank: LR schedule, RNG states (python, torch, CUDA, tracker)
        rollout.pkl                    rank 0: dataset position, prompts in flight / re-queued,
                                       buffered groups with their versions, staleness counters
    latest                             "step_000012" (atomically replaced after the rename)

Resuming with the same layout is exact, RNG included (tests/e2e/test_resume.py). Resuming with another
layout (more GPUs, a different TP/PP split) loads the same weights and optimizer moments — the next
step equals the uninterrupted run's up to float reduction order (tests/distributed/test_checkpoint_layouts.py)
— and keeps the RNG of the new run's initialisation (the saved per-rank states belong to other
ranks). The distributed optimizer is saved "fully_reshardable". Checkpoints of the earlier per-rank
format (trainer/rank_*.pt with the model inside) still load with their own layout.

Only `keep_last` complete checkpoints are kept. Never load one from an untrusted source: the files
are pickles.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_flash.trainer.lora import adapter_checkpoint_keys
from megatron_flash.trainer.patches import optimizer_load
from megatron_flash.trainer.patches.async_save import save_dist_checkpoint
from megatron_flash.trainer.patches.optimizer_load import adam_optimizers

logger = logging.getLogger(__name__)

LATEST = "latest"


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:06d}")


def latest_checkpoint(save_dir: str) -> Optional[str]:
    """The directory `latest` names, if it is complete (has meta.json)."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(save_dir, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # no tracker initialised (e.g. rollout-only)
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _init_empty_adam_state(policy: Any) -> None:
    """Before loading into a fresh optimizer: give torch Adam its state tensors (step 0, zero moments).
    Megatron's distributed optimizer reads the current state to build the sharded state dict it
    loads into, and torch Adam creates it only at the first step (Megatron relies on TE/Apex Adam,
    which keep `step` in param_groups, for this; they are absent on CPU)."""
    for _, inner in adam_optimizers(policy.optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def _unshare_adam_steps(policy: Any) -> None:
    """megatron-core 0.16's distributed optimizer, without TE/Apex, restores torch Adam's `step` as ONE
    tensor shared by every parameter's state; torch Adam increments it in place per parameter, so the
    next step's bias correction would count every parameter (measured: weights off by 1e-3 after one
    step). Give each parameter its own copy."""
    for _, inner in adam_optimizers(policy.optimizer):
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _model_chunks(policy: Any) -> list[tuple[str, Any]]:
    """State keys and the unwrapped model chunks: "model", or "model0", "model1", … under an
    interleaved pipeline (Megatron's naming)."""
    chunks = [getattr(c, "module", c) for c in policy.chunks]  # under Megatron's DDP wrapper
    if len(chunks) == 1:
        return [("model", chunks[0])]
    return [(f"model{i}", c) for i, c in enumerate(chunks)]


def _sharded_state(policy: Any, *, is_loading: bool) -> dict[str, Any]:
    if is_loading:
        _init_empty_adam_state(policy)
    state = {key: chunk.sharded_state_dict() for key, chunk in _model_chunks(policy)}
    if _lora(policy) is not None:  # the frozen base is model.hf_path's: only the adapters are saved
        state = {key: adapter_checkpoint_keys(chunk) for key, chunk in state.items()}
    state["optimizer"] = policy.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_OPTIM_METADATA)
    return state


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error); the previous one stays `latest`."""


def save(policy: Any, save_dir: str, *, step: int, version: int, rollout_state: Optional[dict[str, Any]],
         keep_last: int = 2, group: Any = None) -> str:
    """Collective over every trainer rank. Returns the checkpoint directory. A write that fails
    raises CheckpointError naming the directory, the cause and the checkpoint a resume would use;
    the partial directory is removed and `latest` is left as it was."""
    final = step_dir(save_dir, step)
    try:
        return _save(policy, save_dir, final, step=step, version=version, rollout_state=rollout_state,
                     keep_last=keep_last, group=group)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        cause = _cause(e, save_dir)  # before the partial write is removed: that frees the space
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(save_dir, LATEST + ".tmp"))
        last = latest_checkpoint(save_dir)
        raise CheckpointError(f"checkpoint {final} could not be written ({cause}); "
                              + (f"the last complete checkpoint is {last}, which a resume starts from" if last
                                 else "no complete checkpoint exists: a resume starts from scratch")) from e


def _cause(error: BaseException, save_dir: str) -> str:
    """Why the write failed: the OSError behind `error` when there is one. torch's file writer
    reports a short write without its errno ("unexpected pos ..."), so the directory is then probed
    with a write of its own, which names a full disk, a quota or a file-size limit."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    what = f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
    probe = os.path.join(save_dir, f".write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"{what}; a probe write to {save_dir} failed too: {type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return what


PROBE_BYTES = 8 << 20
"""Size of the probe write after a failed checkpoint: larger than a write that a nearly full disk still takes."""


def _save(policy: Any, save_dir: str, final: str, *, step: int, version: int, rollout_state: Optional[dict[str, Any]],
          keep_last: int, group: Any) -> str:
    layout = policy.layout
    tmp = final + ".tmp"
    if layout.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "trainer"))  # empty: Megatron warns about a non-empty target
        os.makedirs(os.path.join(tmp, "rank_state"))
    dist.barrier(group=group)
    save_dist_checkpoint(_sharded_state(policy, is_loading=False), os.path.join(tmp, "trainer"))
    rank_state = {"scheduler": policy.scheduler.state_dict(), "rng": _rng_state(), "step": step, "version": version}
    torch.save(rank_state, os.path.join(tmp, "rank_state", f"rank_{layout.rank:05d}.pt"))
    if layout.rank == 0 and rollout_state is not None:
        with open(os.path.join(tmp, "rollout.pkl"), "wb") as f:
            pickle.dump(rollout_state, f)
    dist.barrier(group=group)
    if layout.rank == 0:
        meta = {"step": step, "version": version, "format": "megatron-dist", "world_size": layout.world_size,
                "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size, "cp": layout.cp_size}
        if _lora(policy) is not None:
            meta["lora"] = _lora(policy)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, LATEST + ".tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(save_dir, LATEST + ".tmp"), os.path.join(save_dir, LATEST))
        _prune(save_dir, keep_last)
    dist.barrier(group=group)
    return final


def _prune(save_dir: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(save_dir) if d.startswith("step_") and not d.endswith(".tmp"))
    for name in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    for name in os.listdir(save_dir):  # leftovers of a save that died midway
        if name.endswith(".tmp") and name.startswith("step_"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def load(policy: Any, path: str) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Load this rank's trainer state from checkpoint `path`; returns (meta, rollout_state or None)."""
    layout = policy.layout
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    want = {"world_size": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size, "cp": layout.cp_size}
    have = {k: meta.get(k, 1) if k == "cp" else meta[k] for k in want}  # checkpoints before CP: cp 1
    _check_lora_meta(policy, meta, path)
    if meta.get("format") == "megatron-dist":
        from megatron.core import dist_checkpointing

        sharded = _sharded_state(policy, is_loading=True)
        optimizer_load.skip_step_on_reshardable_load(policy.optimizer)
        loaded = dist_checkpointing.load(sharded, os.path.join(path, "trainer"))
        for key, chunk in _model_chunks(policy):
            if _lora(policy) is None:
                chunk.load_state_dict(loaded[key])
                continue
            missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
            missing = [k for k in missing if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")]
            if missing or unexpected:  # the base's keys are expected missing, nothing else
                raise ValueError(f"checkpoint {path}: adapter keys missing {missing[:3]}, unexpected {unexpected[:3]}")
        policy.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(policy)
        same = have == want
        # Same layout: this rank's own RNG and schedule. Another layout: rank 0's schedule (every
        # rank steps it alike); the RNG stays as the new run seeded it.
        state = torch.load(os.path.join(path, "rank_state", f"rank_{layout.rank if same else 0:05d}.pt"),
                           weights_only=False)
        policy.scheduler.load_state_dict(state["scheduler"])
        if same:
            _set_rng_state(state["rng"])
        elif layout.rank == 0:
            logger.warning("checkpoint %s was saved with layout %s; resuming with %s: weights, optimizer and "
                           "LR schedule restored, RNG states re-seeded", path, have, want)
        return meta, _load_rollout(path, layout.rank)
    if have != want:  # the earlier per-rank format holds this layout's shards only
        raise ValueError(f"checkpoint {path} (per-rank format) was saved with layout {have}; this run has "
                         f"{want} (resume it with the same parallel layout)")
    state = torch.load(os.path.join(path, "trainer", f"rank_{layout.rank:05d}.pt"), weights_only=False)
    for key, chunk in _model_chunks(policy):
        chunk.load_state_dict(state[key])
    policy.optimizer.load_state_dict(state["optimizer"])
    if getattr(policy.settings.optimizer, "use_distributed_optimizer", False):
        policy.optimizer.load_parameter_state(os.path.join(path, "trainer", f"dist_opt_{layout.rank:05d}.pt"))
    policy.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return meta, _load_rollout(path, layout.rank)


def _lora(policy: Any) -> Optional[dict[str, Any]]:
    """What a LoRA checkpoint records of its adapters and base (None without LoRA)."""
    options = getattr(policy.settings, "lora", None)
    if options is None or not options.enabled:
        return None
    from megatron_flash.hf.adapters import base_fingerprint

    return {"rank": options.rank, "alpha": options.alpha, "targets": list(options.targets),
            "base": os.path.abspath(policy.settings.hf_path), "base_fingerprint": base_fingerprint(policy.settings.hf_path)}


def _check_lora_meta(policy: Any, meta: dict[str, Any], path: str) -> None:
    """A LoRA checkpoint resumes only as LoRA, with the same adapters, on the base it was trained on."""
    have, want = meta.get("lora"), _lora(policy)
    if have is None and want is None:
        return
    if have is None or want is None:
        raise ValueError(f"checkpoint {path} holds {'LoRA adapters' if have else 'full weights'}; this run trains "
                         f"{'LoRA adapters' if want else 'full weights'} (model.lora.rank={want['rank'] if want else 0})")
    for key in ("rank", "alpha", "targets"):
        if have[key] != want[key]:
            raise ValueError(f"checkpoint {path} holds adapters with {key}={have[key]!r}; this run has "
                             f"model.lora.{key}={want[key]!r}")
    if have["base_fingerprint"] != want["base_fingerprint"]:
        raise ValueError(f"checkpoint {path} holds adapters of base {have['base']} (fingerprint "
                         f"{have['base_fingerprint']}); this run's model.hf_path={want['base']} is another model "
                         f"(fingerprint {want['base_fingerprint']})")


def _load_rollout(path: str, rank: int) -> Optional[dict[str, Any]]:
    if rank != 0 or not os.path.isfile(os.path.join(path, "rollout.pkl")):
        return None
    with open(os.path.join(path, "rollout.pkl"), "rb") as f:
        return pickle.load(f)
