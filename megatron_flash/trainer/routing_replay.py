"""Rollout routing replay (R3): every trainer forward of a sample routes each token to the experts
the engine used when it generated that sample, and the agreement between the two is measured.

Megatron-Core's router replay does the routing: with `moe_enable_routing_replay` each TopKRouter
owns a `RouterReplay`; given target indices [tokens it sees, top_k] and the action REPLAY_FORWARD,
the router takes those experts and gathers their probabilities from its own scores, so the router
still learns (the load-balancing loss keeps using the router's own top-k). The targets are set per
micro-batch, before its forward, on the routers of the model chunk that runs it: the router's rows
are the micro-batch's tokens sequence-major ([T, r] flattened), under sequence parallel this tensor
rank's slice of T. Tokens without a recorded route (each sample's last token, padding, filler rows)
get experts 0..k-1: nothing real attends to them.

Not Megatron's global registry: it holds every router ever built in the process (reference model,
tests), so this class keeps its own per-chunk list.

Metrics (over real tokens with a recorded route, every router layer, summed over ranks):
  moe_route_agreement  fraction of (token, layer) whose own top-k set (from the router's logits)
                       equals the engine's: train–inference routing mismatch, with or without replay
  moe_route_replayed   fraction whose *used* experts equal the engine's (1.0 when replay is on)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def routers_of(chunk: Any) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def fill_unrouted(routes: torch.Tensor, routed: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., L * k] routes with rows where `routed` is False set to experts 0..k-1 in every layer."""
    filler = torch.arange(top_k, dtype=routes.dtype).repeat(routes.shape[-1] // top_k)
    return torch.where(routed[..., None], routes, filler)


class RoutingReplay:
    def __init__(self, chunks: list[Any], *, num_layers: int, top_k: int, replay: bool) -> None:
        self.num_layers, self.top_k, self.replay = num_layers, top_k, replay
        self._routers: dict[int, list[Any]] = {}
        self.counts = torch.zeros(3, dtype=torch.float64)  # own agree, used agree, total
        self._targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(router) → (routes, routed)
        self.attach(chunks)

    def attach(self, chunks: list[Any]) -> None:
        """Register the routers of a model (the trained chunks, or the reference model's)."""
        for chunk in chunks:
            routers = routers_of(chunk)
            for router in routers:
                if router.router_replay is None:
                    raise RuntimeError("routing replay needs TransformerConfig.moe_enable_routing_replay=True")
                router.register_forward_hook(self._measure)
            self._routers[id(chunk)] = routers
            inner = getattr(chunk, "module", None)  # DDP wrapper: the schedule may pass either
            if inner is not None:
                self._routers[id(inner)] = routers

    def before_forward(self, chunk: Any, routes: Optional[torch.Tensor], routed: Optional[torch.Tensor]) -> None:
        """Targets of the micro-batch about to run through `chunk` (routes [r, T, L * k], routed [r, T])."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self._routers.get(id(chunk), [])
        for router in routers:
            self._targets.pop(id(router), None)
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        if routes is None or not routers:
            return
        rows, mask = self._router_rows(routers[0], routes, routed)
        for router in routers:
            layer = router.layer_number - 1
            target = rows[:, layer * self.top_k:(layer + 1) * self.top_k].long()
            self._targets[id(router)] = (target, mask)
            if self.replay:
                router.router_replay.set_target_indices(target)
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _router_rows(self, router: Any, routes: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[r, T, ...] → the router's row order: [T, r] flattened, this rank's slice of T under SP."""
        routes = fill_unrouted(routes, routed, self.top_k).transpose(0, 1)
        routed = routed.transpose(0, 1)
        if router.config.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            part = routes.shape[0] // tp
            routes, routed = routes[rank * part:(rank + 1) * part], routed[rank * part:(rank + 1) * part]
        return routes.reshape(-1, routes.shape[-1]), routed.reshape(-1)

    @torch.no_grad()
    def _measure(self, module: Any, inputs: Any, output: Any) -> None:
        held = self._targets.get(id(module))
        if held is None:
            return
        target, mask = held
        _, routing_map = output
        if routing_map.shape[0] != target.shape[0]:
            raise RuntimeError(f"router of layer {module.layer_number} saw {routing_map.shape[0]} tokens, "
                               f"the replayed routes have {target.shape[0]}")
        logits = module.gating(inputs[0]).view(-1, routing_map.shape[-1])
        own = torch.zeros_like(routing_map).scatter(1, torch.topk(logits, self.top_k, dim=1).indices, True)
        engine = torch.zeros_like(routing_map).scatter(1, target.to(routing_map.device), True)
        mask = mask.to(routing_map.device)
        self.counts[0] += float(((own == engine).all(1) & mask).sum())
        self.counts[1] += float(((routing_map.bool() == engine).all(1) & mask).sum())
        self.counts[2] += float(mask.sum())

    def clear(self) -> None:
        """Drop every target (after a step or a forward-only pass: Megatron would keep them)."""
        for routers in self._routers.values():
            for router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        self._targets.clear()

    def collect(self, device: torch.device) -> dict[str, float]:
        """Collective over every rank; also resets."""
        buf = self.counts.to(device)
        dist.all_reduce(buf)
        own, used, total = buf.cpu().tolist()
        self.counts.zero_()
        if total == 0:
            return {}
        return {"moe_route_agreement": own / total, "moe_route_replayed": used / total}
