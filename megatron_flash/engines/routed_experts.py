"""The experts a MoE engine routed each token to, recorded during generation (SGLang's
`return_routed_experts`, for rollout routing replay).

SGLang's reply field `meta_info.routed_experts` is base64 of little-endian int32 [prompt +
completion - 1, num_moe_layers, top_k]: row t holds the experts used when token t was the model's
input (the last sampled token is never fed, so it has none). The local engine records the same rows
from inside transformers' continuous batching: every CB step packs the query tokens of several
requests into one forward, so before the forward the engine notes the step's layout (request,
first position, token count) and a forward hook on each layer's router writes that layer's top-k
ids into each request's table at those positions. A request re-prefilled after a retract writes its
rows again from the new forward, as SGLang recomputes them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)


def _moe_routers(model: Any) -> list[Any]:
    """The router of every sparse layer, in layer order (transformers' Qwen3-MoE family: a `gate`
    module returning (logits, top-k weights, top-k expert ids))."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    routers = []
    for layer in layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            routers.append(gate)
    return routers


class RouteRecorder:
    """Per-request routing tables of a CB engine. `lookup(cb_id)` gives the request's table (a
    [max_rows, layers, top_k] int32 tensor, or None when it did not ask for routes)."""

    def __init__(self, model: Any, lookup: Callable[[str], Optional[torch.Tensor]]) -> None:
        self.routers = _moe_routers(model)
        self.lookup = lookup
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self._layout: list[tuple[str, int, int]] = []  # (cb id, first position, tokens) of this step
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))
        if self.routers:
            model.register_forward_hook(lambda *_: self._layout.clear())

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    def new_table(self, max_rows: int) -> torch.Tensor:
        return torch.zeros(max_rows, len(self.routers), self.top_k, dtype=torch.int32)

    def note_batch(self, requests_in_batch: list) -> None:
        """Called by CB's batch preparation (after each request's position offset moved past its
        query tokens), before the step's forward."""
        if not self.routers:
            return
        self._layout = [(fs.state.request_id, fs.state.position_offset - fs.query_length, fs.query_length)
                        for fs in requests_in_batch]

    def note_layout(self, layout: list[tuple[str, int, int]]) -> None:
        """The static decoder's layout of the next forward: (cb id, first position, tokens) per packed
        run of rows, in row order ("" for a row no request owns)."""
        if self.routers:
            self._layout = list(layout)

    def _hook(self, layer: int) -> Callable[..., None]:
        def record(module: Any, inputs: Any, output: Any) -> None:
            if not self._layout:
                return
            ids = output[2]
            row = 0
            for cb_id, start, count in self._layout:
                table = self.lookup(cb_id)
                if table is not None and row + count <= ids.shape[0]:
                    end = min(start + count, table.shape[0])
                    table[start:end, layer] = ids[row:row + end - start].to(torch.int32)
                row += count
        return record


def encoded_routes(table: torch.Tensor, rows: int) -> str:
    """The first `rows` rows of a request's table in SGLang's wire format."""
    from megatron_flash.types import encode_routes

    return encode_routes(table[:rows].reshape(rows, -1))
