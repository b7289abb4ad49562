"""Per-step MoE metrics of the trainer: how evenly the routers spread tokens over experts, and the
load-balancing loss Megatron added.

  train/moe_expert_load_max   mean over layers of (tokens of the busiest expert / mean tokens per
                              expert) in this step's training forwards: 1.0 = perfectly balanced,
                              E/k = every token to the same k experts
  train/moe_aux_loss          Megatron's load-balancing loss (before its coefficient), mean over
                              layers and micro-batches

Counts come from a forward hook on every router (the routing map it returns), over the samples'
tokens only (padding and filler rows are routed too, and left out here: the trainer sets `current`,
the micro-batch's real-token mask, before each forward), summed over all ranks (pipeline stages hold
different layers; tensor-parallel ranks without sequence parallel see the same tokens, which scales a
layer's counts uniformly and leaves the ratio alone). The loss is read from
Megatron's per-layer tracker and reduced here with SUM only (its own reduction averages, which gloo
cannot do).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RouterStats:
    def __init__(self, chunks: list[Any], *, num_layers: int, num_experts: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.current: Any = None  # [r, T] bool real-token mask of the micro-batch being computed
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._hook)

    def _hook(self, module: Any, inputs: Any, output: Any) -> None:
        if module.layer_number is None or not module.training:
            return
        _, routing_map = output
        routed = routing_map.detach().to("cpu", torch.float64)
        real = self._real_rows(module, routed.shape[0])
        if real is not None:
            routed = routed[real]
        self.counts[module.layer_number - 1] += routed.sum(0)

    def _real_rows(self, module: Any, num_rows: int) -> Any:
        """The router's rows that are real tokens: its input is [T, r] flattened (sequence-major),
        under sequence parallel this TP rank's slice of T."""
        if self.current is None:
            return None
        real = self.current.t().contiguous()  # [T, r]
        if module.config.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            part = real.shape[0] // tp
            real = real[rank * part:(rank + 1) * part]
        real = real.reshape(-1)
        return real if real.numel() == num_rows else None

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()

    def collect(self, num_micro_batches: int, device: torch.device) -> dict[str, float]:
        """Collective over every rank; also resets."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        layers = self.counts.shape[0]
        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = tracked["values"].detach().to("cpu", torch.float64) if tracked else torch.zeros(layers, dtype=torch.float64)
        held = (self.counts.sum(1) > 0).double() * num_micro_batches  # micro-batches each layer ran here
        buf = torch.cat([self.counts.flatten(), aux, held]).to(device)
        dist.all_reduce(buf)
        buf = buf.cpu()
        counts = buf[: self.counts.numel()].view_as(self.counts)
        aux, held = buf[self.counts.numel():-layers], buf[-layers:]
        seen = counts.sum(1) > 0
        out: dict[str, float] = {}
        if bool(seen.any()):
            ratio = counts[seen].max(1).values / counts[seen].mean(1)
            out["moe_expert_load_max"] = float(ratio.mean())
        if tracked and bool((held > 0).any()):
            out["moe_aux_loss"] = float((aux[held > 0] / held[held > 0]).mean())
        self.reset()
        return out


def moe_padding_mask(model: Any, routable: torch.Tensor) -> torch.Tensor:
    """Megatron's MoE padding mask ([r, T], True = padding) for one forward: padding stays out of
    the load-balancing loss and the router's token counts. Without it a packed row's padding tail
    (zero hidden states, its own attention segment) sent the loss's gradient through RMSNorm at 0,
    scaled by 1/sqrt(eps), into the embedding (measured ~1e5 x the policy gradient at EP2).
    GPTModel scatters the mask over sequence-parallel ranks on the first pipeline stage only: later
    stages get their slice here."""
    pad = ~routable
    inner = getattr(model, "module", model)
    if inner.config.sequence_parallel and not inner.pre_process:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        part = pad.shape[1] // tp
        pad = pad[:, rank * part:(rank + 1) * part]
    return pad
