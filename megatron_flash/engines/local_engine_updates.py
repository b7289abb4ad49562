"""The local engine's memory hand-off (colocated mode) and weight updates, as SGLang's endpoints
behave: a mixin of `LocalEngine` (engines/local_engine.py), which owns the state it uses: `model`, the CB
`_decoder` and its factory, `_gate` / `_update_lock` / `_lock`, `_live` requests, `_paused`,
`_released` tags, the weight-update `_groups` and `_session_open`.

Updates run with SGLang's locking: immediately when generation is paused, otherwise after the in-flight
requests finish while new ones wait; the batching loop is parked while tensors are written in place.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
from typing import Any, Callable

import torch

from megatron_flash.engines import shared_weights, weight_payloads
from megatron_flash.engines.weight_delta import DeltaReceiver, is_delta_part
from megatron_flash.engines.cuda_handles import forget_mappings
from megatron_flash.engines.process_group import new_weight_update_group

logger = logging.getLogger(__name__)

_FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                  "queued. Retract or finish them, then call /flush_cache.")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory-occupation tags; none given = all of them."""


def _memory_tags(tags: list[str] | None) -> list[str]:
    if tags is None or len(tags) == 0:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"tags: {tags!r}; each must be one of {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class EngineUpdates:
    # ------------------------------------------------------------------ memory occupation (colocated mode)
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this process holds now: the served weights (live tensors) and its resident set."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"weights_bytes": weights, "rss_bytes": rss}

    def _idle_error(self) -> str:
        busy = [r.rid for r in self._live.values() if r.finish is None]
        if busy or self._retracted:
            return (f"release_memory_occupation should be called only when server is idle: "
                    f"{len(busy)} request(s) running ({', '.join(busy[:3])}{'...' if len(busy) > 3 else ''}); "
                    "pause_generation(mode=abort) first")
        return ""

    async def release_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """SGLang's /release_memory_occupation on CPU: `weights` frees every parameter's storage (the
        values are lost, as with SGLang's memory saver without CPU backup: push weights after resume),
        `kv_cache` stops the batching loop and frees its paged cache, `cuda_graph` has nothing to free.
        Requests that arrive meanwhile wait at admission until everything is resumed."""
        self._ensure_loop_state()
        tags = _memory_tags(tags)
        error = self._idle_error()
        if error:
            raise ValueError(error)
        before = self.memory_bytes()
        async with self._gate:
            new = [t for t in tags if t not in self._released]
            self._released.update(tags)
            self.num_releases += 1
        if "kv_cache" in new:
            manager, self._decoder = self._decoder, None
            await asyncio.to_thread(manager.stop, block=True, timeout=10, hard_stop=True)
            del manager
        if "weights" in new:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    self._weight_meta[name] = (param.shape, param.dtype)
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        forget_mappings()  # the trainer may reuse its GPU memory while this engine sleeps
        gc.collect()
        _malloc_trim()
        return {"released": sorted(self._released), "before": before, "after": self.memory_bytes()}

    async def resume_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """Take the released memory back. Resumed weights are zeros until the next weight update."""
        self._ensure_loop_state()
        tags = _memory_tags(tags)
        missing = [t for t in tags if t not in self._released and t != "cuda_graph"]
        if missing:
            raise ValueError(f"resume_memory_occupation: tag(s) {missing} are not released "
                             f"(released: {sorted(self._released) or 'none'})")
        before = self.memory_bytes()
        if "weights" in tags:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    shape, dtype = self._weight_meta.pop(name)
                    param.data = torch.zeros(shape, dtype=dtype, device=self.device)
            if self._decoder is not None:  # graphs captured before point at the released storage
                self._decoder.reset_graphs()
        if "kv_cache" in tags:
            self._decoder = await asyncio.to_thread(self._new_decoder)
        async with self._gate:
            self._released.difference_update(tags)
            self._gate.notify_all()
        return {"released": sorted(self._released), "before": before, "after": self.memory_bytes()}

    # ------------------------------------------------------------------ weight updates
    async def run_weight_update(self, load: Callable[[], str], *, weight_version: str | None,
                                flush_cache: bool, abort_all_requests: bool = False) -> tuple[bool, str]:
        """Run `load` (in a thread, CB parked) with SGLang's locking: immediately when paused, otherwise after the
        in-flight requests finish while new ones wait. Returns (success, message) as SGLang's endpoints."""
        self._ensure_loop_state()
        if abort_all_requests:
            self.abort(abort_all=True)
        async with self._update_lock:
            if not self._paused:
                async with self._gate:
                    self._num_updates_waiting += 1
                try:
                    while any(r.finish is None for r in self._live.values()):
                        await asyncio.sleep(0.005)
                    success, message = await self._load_parked(load)
                finally:
                    async with self._gate:
                        self._num_updates_waiting -= 1
                        self._gate.notify_all()
            else:
                success, message = await self._load_parked(load)
        if success:
            self._set_version(weight_version)
            if weight_version is not None:
                message += f" Weight version updated to {weight_version}."
            if flush_cache and self.holds_kv():
                return False, _FLUSH_REFUSED
        return success, message

    def _parked(self) -> Any:
        """CB paused for the duration (nothing to pause while the KV cache, with its loop, is released)."""
        import contextlib

        return contextlib.nullcontext() if self._decoder is None else self._decoder.pause()

    async def _load_parked(self, load: Callable[[], str]) -> tuple[bool, str]:
        def parked() -> str:
            with self._parked():
                return load()
        try:
            return True, await asyncio.to_thread(parked)
        except Exception as error:
            logger.exception("weight update failed")
            return False, f"Failed to update weights: {error}"

    async def input_token_logprobs(self, prompt_ids: list[int], start: int, *, return_text: bool = False,
                                   top_k: int = 0) -> dict[str, Any]:
        """SGLang's input logprobs for `logprob_start_len=start` as meta_info fields:
        `input_token_logprobs`, one [logprob, token_id, text] per prompt position start…end, the first
        logprob None (SGLang's logits start at that position); with `top_k` > 0 also
        `input_top_logprobs` (per position None first, then the k most likely [logprob, token_id, text],
        most likely first) and `last_top_logprobs`, the k most likely next tokens after the prompt. A
        teacher-forced forward of the served model (temperature 1), CB parked, no update running."""
        if start >= len(prompt_ids) and not top_k:
            return {"input_token_logprobs": []}

        @torch.no_grad()
        def forward() -> tuple[list[float], list[list[float]], list[list[int]]]:
            if "weights" in self._released:
                raise ValueError("the weights are released (release_memory_occupation): resume them first")
            with self._parked():
                logits = self.model(input_ids=torch.tensor([prompt_ids], device=self.device)).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = logprobs[:-1].gather(-1, torch.tensor(prompt_ids[1:], device=self.device)[:, None])[:, 0]
            if not top_k:
                return picked.tolist(), [], []
            top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            return picked.tolist(), top.values.tolist(), top.indices.tolist()

        self._ensure_loop_state()
        async with self._update_lock:
            values, top_values, top_ids = await asyncio.to_thread(forward)

        def text(t: int) -> Any:
            return self.tokenizer.decode([t]) if return_text and self.tokenizer is not None else None

        ids = prompt_ids[start:]
        out: dict[str, Any] = {"input_token_logprobs": [[lp, t, text(t)] for lp, t in zip([None] + values[start:], ids)]}
        if top_k:
            # Row j of the forward predicts token j + 1: position p's entry is row p − 1 (none for the first).
            rows = [[[lp, t, text(t)] for lp, t in zip(top_values[p - 1], top_ids[p - 1])]
                    for p in range(start + 1, len(prompt_ids))]
            out["input_top_logprobs"] = ([None] + rows) if start < len(prompt_ids) else []
            out["last_top_logprobs"] = [[lp, t, text(t)] for lp, t in zip(top_values[-1], top_ids[-1])]
        return out

    def _set_version(self, new_version: str | None) -> None:
        if new_version is None or new_version == self.weight_version:
            return
        with self._lock:
            for req in self._live.values():
                if req.finish is None and req.output_ids:
                    req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = new_version

    def begin_session(self) -> tuple[bool, str]:
        if self._session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session_open = True
        self.delta_receiver().reset()
        self._delta_staging = {}
        return True, "Success"

    # ------------------------------------------------------------------ delta pushes (engines/weight_delta.py)
    def delta_receiver(self) -> DeltaReceiver:
        receiver = getattr(self, "_delta", None)
        if receiver is None:
            params = self.model.state_dict(keep_vars=True)
            receiver = self._delta = DeltaReceiver(lambda name: checkpoint_param(params, name),
                                                   lambda: self.weight_version)
            self._delta_staging: dict[str, list] = {}
            self.delta_counts = {"applied": 0, "changed": 0, "verified": 0, "failed": 0}
        return receiver

    def finish_delta(self, verify_tensors: int | None) -> str:
        """The final call of a push: '' when its checksums verify (or it carried none and none was
        asked for), else why the version must not be taken. Counted in /get_server_info."""
        receiver = self.delta_receiver()
        staged = list(self._delta_staging)
        self._delta_staging = {}
        if verify_tensors is None:
            if receiver.seen:
                receiver.reset()
                return "this push carried delta parts but the final call asks for no verification (verify_tensors)"
            return ""
        applied, changed = receiver.applied, receiver.changed
        problem = receiver.finish(int(verify_tensors))
        if staged:
            problem = "; ".join(p for p in (problem, f"{len(staged)} delta part(s) arrived in part only") if p)
        self.delta_counts["applied"] += applied
        self.delta_counts["changed"] += changed
        self.delta_counts["verified" if not problem else "failed"] += 1
        if problem:
            logger.warning("weight update refused: %s", problem)
        return problem

    def end_session(self) -> tuple[bool, str]:
        if not self._session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session_open = False
        return True, "Success"

    def require_session(self, endpoint: str) -> None:
        if not self._session_open:
            raise ValueError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the served model in place (all names and shapes checked first);
        delta parts (engines/weight_delta.py) go to the push's receiver, which applies them."""
        if "weights" in self._released:
            raise ValueError("the weights are released (release_memory_occupation): "
                             "resume_memory_occupation(tags=['weights']) before updating them")
        if any(is_delta_part(n) for n, _ in named):
            named = self.delta_receiver().take(named)
        params = self.model.state_dict(keep_vars=True)  # includes tied aliases such as lm_head.weight
        targets = []
        for name, tensor in named:
            target = checkpoint_param(params, name)
            if target is None:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"shape of {name}: got {tuple(tensor.shape)}, model has {tuple(target.shape)}")
            targets.append(target)
        with torch.no_grad():
            for target, (_, tensor) in zip(targets, named):
                target.copy_(tensor.to(dtype=target.dtype, device=target.device))
        self.forget_base()  # new base weights: a merged LoRA adapter is gone with the old ones
        # A sender reuses its CUDA buffers once this update is answered: every copy must be done by then.
        for device in {t.device for _, t in named if t.is_cuda} | {t.device for t in targets if t.is_cuda}:
            torch.cuda.synchronize(device)

    def load_from_disk(self, model_path: str, load_format: str | None, verify_tensors: int | None = None) -> str:
        """A checkpoint directory; with `verify_tensors` a folder of encoded buckets (weight_sync/transports/
        disk.py), verified before the call succeeds (it then carries the version)."""
        if verify_tensors is None:
            self.load_named_tensors(weight_payloads.read_disk_weights(model_path, load_format))
            self.model_path = model_path
            self.load_format = load_format or "auto"
            return "Succeeded to update model weights."
        self.delta_receiver().reset()
        self.load_named_tensors(weight_payloads.read_disk_weights(model_path, load_format))
        problem = self.finish_delta(verify_tensors)
        if problem:
            raise ValueError(problem)
        return f"Succeeded to update model weights ({verify_tensors} tensors verified)."

    def load_from_shared_memory(self, body: dict) -> str:
        """The bridge's staged ipc: pieces of tensors in a mapped shared buffer (engines/shared_weights.py)."""
        if "weights" in self._released:
            raise ValueError("the weights are released (release_memory_occupation): "
                             "resume_memory_occupation(tags=['weights']) before updating them")
        pieces = self._shared_buffers.pieces(body)
        params = self.model.state_dict(keep_vars=True)
        parts = [p for p in pieces if is_delta_part(p.name)]
        if parts:
            pieces = [p for p in pieces if not is_delta_part(p.name)]
            self._stage_delta_parts(parts)
        shared_weights.copy_pieces(pieces, lambda name: checkpoint_param(params, name))
        self.forget_base()
        return "Success"

    def _stage_delta_parts(self, parts: list) -> None:
        """Delta parts arrive in pieces like any tensor: gathered here until whole, then applied."""
        receiver = self.delta_receiver()
        complete = []
        for piece in parts:
            entry = self._delta_staging.get(piece.name)
            if entry is None:
                entry = self._delta_staging[piece.name] = [torch.empty(piece.shape, dtype=piece.dtype), 0]
            buffer = entry[0]
            buffer.view(-1)[piece.start:piece.start + piece.source.numel()].copy_(piece.source)
            entry[1] += piece.source.numel()
            if entry[1] == buffer.numel():
                del self._delta_staging[piece.name]
                complete.append((piece.name, buffer))
        if complete:
            receiver.take(complete)

    def load_from_tensor_payload(self, payload: bytes, load_format: str | None) -> str:
        self.load_named_tensors(weight_payloads.read_tensor_payload(payload, load_format))
        return "Success"

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> str:
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        self._groups[group_name] = new_weight_update_group(
            master_address=master_address, master_port=master_port, rank=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend)
        return "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> str:
        group = self._groups.pop(group_name, None)
        if group is None:
            raise ValueError("The group to be destroyed does not exist.")
        torch.distributed.destroy_process_group(group)
        return "Succeeded to destroy custom process group."

    def receive_broadcast(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                          load_format: str | None) -> str:
        """Receive one SGLang-style broadcast from rank 0 over `group_name` and load it."""
        if group_name not in self._groups:
            raise ValueError(f"Group {group_name} not in {list(self._groups)}. "
                             "Please call `init_weights_update_group` first.")
        self.load_named_tensors(weight_payloads.receive_broadcast(
            self._groups[group_name], names=names, dtypes=dtypes, shapes=shapes, load_format=load_format,
            # NCCL receives into device memory; gloo into host memory, copied to the weights after
            device=self.device if torch.distributed.get_backend(self._groups[group_name]) == "nccl" else "cpu"))
        return "Succeeded to update parameter online."


_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The served model's storage for a tensor named as in the HF checkpoint, or None.

    Checkpoints (and the trainer) name each expert's weights apart (`mlp.experts.{e}.gate_proj.weight`);
    transformers keeps a MoE layer's experts fused in memory (`experts.gate_up_proj` [E, 2·I, H] with
    gate rows first, `experts.down_proj` [E, H, I]), so such a name resolves to a view of that expert's
    slice."""
    if name in params:
        return params[name].data
    m = _EXPERT_WEIGHT.match(name)
    if m is None:
        return None
    proj = m.group("proj")
    fused = params.get(m.group("experts") + (".down_proj" if proj == "down_proj" else ".gate_up_proj"))
    index = int(m.group("index"))
    if fused is None or fused.dim() != 3 or index >= fused.shape[0]:
        return None
    expert = fused.data[index]
    if proj == "down_proj":
        return expert
    half = expert.shape[0] // 2
    return expert[:half] if proj == "gate_proj" else expert[half:]
