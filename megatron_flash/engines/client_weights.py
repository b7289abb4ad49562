"""Weight-side calls of `EngineClient`: the begin … end weight-update session, the weight updates
(tensor, staged shared memory, distributed group, disk, version label) and the colocated hand-off of
engine memory (release / resume). None is retried here: the caller decides.

Session bookkeeping: ``weight_update_session_mode`` is auto | always | never (see `EngineClient`);
``_server_has_session`` is None until an auto client learns whether the server has the endpoints, and
``_session_state`` is None outside a session, "server" inside one opened on the server, "local" inside
one the server does not know of.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any, AsyncIterator, Dict, Optional, Sequence, Union

from megatron_flash.engines.client_base import EngineError, EngineHTTPError, EngineTransport

SESSION_MODES = ("auto", "always", "never")


class WeightUpdateCalls(EngineTransport):
    """/begin_weight_update … /end_weight_update, /update_weights_from_*, /init_weights_update_group,
    /destroy_weights_update_group, /update_weight_version and /{release,resume}_memory_occupation."""

    weight_update_session_mode: str
    _server_has_session: Optional[bool]
    _session_state: Optional[str]

    # -- engine memory (colocated mode) -------------------------------------------------------
    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None, *,
                                        timeout_s: Optional[float] = None) -> Any:
        """Colocated mode: give the device memory back while the trainer uses it. tags ⊆ weights,
        kv_cache, cuda_graph (none = all); the engine must be idle (pause with mode=abort first).
        Released weights lose their values: resume, then push weights. SGLang needs
        --enable-memory-saver to actually free memory. Returns the reply (SGLang: null)."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self._call("POST", "/release_memory_occupation", body=body,
                                timeout_s=timeout_s or self.control_timeout_s)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None, *,
                                       timeout_s: Optional[float] = None) -> Any:
        body = {} if tags is None else {"tags": list(tags)}
        return await self._call("POST", "/resume_memory_occupation", body=body,
                                timeout_s=timeout_s or self.control_timeout_s)

    # -- weight updates -----------------------------------------------------------------------
    async def begin_weight_update(self, *, timeout_s: Optional[float] = None) -> bool:
        """Open a weight-update session. False when the server has none (auto mode, 404): the
        session is then only local bookkeeping and updates go straight through."""
        if self._session_state is not None:
            raise RuntimeError(f"{self.url}: a weight-update session is already open")
        if self._server_has_session is not False:
            try:
                self._success("/begin_weight_update", await self._call(
                    "POST", "/begin_weight_update", body={"selector": "all"},
                    timeout_s=timeout_s or self.request_timeout_s))
                self._server_has_session = True
            except EngineHTTPError as e:
                if e.status != 404 or self.weight_update_session_mode != "auto":
                    raise
                self._server_has_session = False
        self._session_state = "server" if self._server_has_session else "local"
        return self._server_has_session

    async def end_weight_update(self, *, timeout_s: Optional[float] = None) -> None:
        """Close the session (also one left open on the server by an earlier, crashed caller)."""
        state, self._session_state = self._session_state, None
        if state != "local" and self._server_has_session is not False:
            self._success("/end_weight_update", await self._call(
                "POST", "/end_weight_update", body={}, timeout_s=timeout_s or self.request_timeout_s))

    @property
    def in_weight_update_session(self) -> bool:
        return self._session_state is not None

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """begin … end around several updates (e.g. all buckets of one sync). End runs on error too,
        without hiding the original error."""
        await self.begin_weight_update()
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                await self.end_weight_update()
            raise
        await self.end_weight_update()

    async def _update(self, endpoint: str, body: Dict[str, Any], timeout_s: Optional[float],
                      *, needs_session: bool) -> Dict[str, Any]:
        async def post() -> Dict[str, Any]:
            return self._success(endpoint, await self._call(
                "POST", endpoint, body=body, timeout_s=timeout_s or self.request_timeout_s))

        if not needs_session or self._session_state is not None:
            return await post()
        async with self.weight_update_session():
            return await post()

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[Union[str, bytes]], *,
                                         load_format: Optional[str] = None, flush_cache: bool = True,
                                         weight_version: Optional[str] = None,
                                         timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """One entry per engine TP rank: ``MultiprocessingSerializer.serialize(named_tensors,
        output_str=True)`` (base64 of a ForkingPickler dump); bytes are base64-encoded here."""
        payload = [s if isinstance(s, str) else base64.b64encode(s).decode("ascii")
                   for s in serialized_named_tensors]
        body = {"serialized_named_tensors": payload, "load_format": load_format,
                "flush_cache": flush_cache, "weight_version": weight_version}
        return await self._update("/update_weights_from_tensor", body, timeout_s, needs_session=True)

    async def update_weights_from_shared_memory(self, buffer: Dict[str, Any], tensors: Sequence[Dict[str, Any]], *,
                                                timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """The bridge's staged ipc (not an SGLang endpoint: the local engine advertises it as
        ``weight_update_shared_memory`` in /get_server_info); body in engines/shared_weights.py."""
        body = {"buffer": buffer, "tensors": list(tensors), "flush_cache": False, "weight_version": None}
        return await self._update("/update_weights_from_shared_memory", body, timeout_s, needs_session=True)

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl",
                                        timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Blocks until every member joined: run it concurrently with the trainer's own join."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._update("/init_weights_update_group", body, timeout_s, needs_session=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                           timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Leave and tear down the named weight-update group on the engine."""
        return await self._update("/destroy_weights_update_group", {"group_name": group_name}, timeout_s,
                                  needs_session=False)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False,
                                    verify_tensors: Optional[int] = None,
                                    timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Set the version label the engine reports (meta_info.weight_version) without loading weights.
        `verify_tensors` (the local engine; engines/weight_delta.py): the push that ends here carried
        checksums for that many tensors, which the engine verifies before it takes the version."""
        body: Dict[str, Any] = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        if verify_tensors is not None:
            body["verify_tensors"] = verify_tensors
        return await self._update("/update_weight_version", body, timeout_s, needs_session=False)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None,
                                              timeout_s: Optional[float] = None) -> Dict[str, Any]:
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": weight_version,
                "load_format": load_format}
        return await self._update("/update_weights_from_distributed", body, timeout_s, needs_session=True)

    async def update_weights_from_disk(self, model_path: str, *, load_format: Optional[str] = None,
                                       weight_version: Optional[str] = None, flush_cache: bool = True,
                                       verify_tensors: Optional[int] = None,
                                       timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Reload from a checkpoint directory (no session needed: SGLang wraps it itself); with
        `verify_tensors` a folder of encoded buckets (engines/weight_delta.py), checksums verified."""
        body: Dict[str, Any] = {"model_path": model_path, "load_format": load_format,
                                "weight_version": weight_version, "flush_cache": flush_cache}
        if verify_tensors is not None:
            body["verify_tensors"] = verify_tensors
        return await self._update("/update_weights_from_disk", body, timeout_s, needs_session=False)

    # -- LoRA adapters (SGLang's dynamic LoRA API; it needs --enable-lora) ----------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                                timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Load a PEFT adapter folder under `lora_name`; requests then name it (`lora_path`)."""
        return await self._update("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                                  timeout_s, needs_session=False)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: Dict[str, Any],
                                             serialized_named_tensors: Sequence[Union[str, bytes]], *,
                                             load_format: Optional[str] = None,
                                             timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Load an adapter from tensors (one serialized payload per engine TP rank, as for
        update_weights_from_tensor) with its PEFT adapter_config as `config_dict`."""
        payload = [s if isinstance(s, str) else base64.b64encode(s).decode("ascii")
                   for s in serialized_named_tensors]
        body = {"lora_name": lora_name, "config_dict": dict(config_dict), "serialized_named_tensors": payload,
                "load_format": load_format}
        return await self._update("/load_lora_adapter_from_tensors", body, timeout_s, needs_session=False)

    async def unload_lora_adapter(self, lora_name: str, *, timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """SGLang stops admitting requests that name it at once and unloads it when those running end."""
        return await self._update("/unload_lora_adapter", {"lora_name": lora_name}, timeout_s, needs_session=False)
