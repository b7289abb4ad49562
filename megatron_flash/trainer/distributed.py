"""Process groups: torchrun's environment or a single local process; Megatron's model-parallel state.

Under torchrun the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables are read; a plain
`python` run becomes a world of one on 127.0.0.1 with a free port. The backend is NCCL when CUDA is
available and gloo otherwise (config `parallel.backend` overrides), and the CPU shim is applied only
in the second case.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_flash.hf.layouts import Layout
from megatron_flash.ports import free_ports
from megatron_flash.trainer import megatron_compat
from megatron_flash.trainer.patches import cpu as cpu_patch


def init_distributed(*, tp_size: int, pp_size: int, seed: int, backend: str = "auto",
                     timeout_s: float = 600.0, vpp_size: Optional[int] = None, cp_size: int = 1,
                     ep_size: int = 1, etp_size: Optional[int] = None) -> Layout:
    """Initialise torch.distributed (if needed) and Megatron's parallel state; seed every RNG."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {backend!r}")
    megatron_compat.check(cpu=not torch.cuda.is_available())  # an unknown Megatron fails here, not mid-run
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_ports(1)))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    cpu_patch.apply()
    world = dist.get_world_size()
    if world % (tp_size * pp_size * cp_size) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size × "
            f"pipeline_model_parallel_size × context_parallel_size = {tp_size} × {pp_size} × {cp_size}"
        )
    etp_size = tp_size if etp_size is None else etp_size
    if world % (etp_size * ep_size * pp_size) != 0:
        raise ValueError(
            f"world size {world} is not divisible by expert_tensor_parallel_size × expert_model_parallel_size × "
            f"pipeline_model_parallel_size = {etp_size} × {ep_size} × {pp_size}"
        )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                                 virtual_pipeline_model_parallel_size=vpp_size, context_parallel_size=cp_size,
                                 expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp_size,
                                 distributed_timeout_minutes=timeout_s / 60)  # its groups: the same deadline
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return Layout(
        world_size=world,
        rank=dist.get_rank(),
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ep_size,
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_size=etp_size,
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        cp_size=cp_size,
        cp_rank=ps.get_context_parallel_rank(),
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
