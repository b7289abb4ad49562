"""Inference engines (`engines`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from megatron_flash.config.sections.base import _Section

ENGINE_BACKENDS = ("local", "sglang", "attach")


# SGLang flags that megatron-flash sets itself from `engines.*`; repeating them in
# `engines.server_args` would give two sources of truth for one value.
_ENGINE_OWNED_FLAGS = {
    "model-path": "model.hf_path",
    "model": "model.hf_path",
    "host": "engines.host",
    "port": "engines.base_port",
    "tp-size": "engines.tp_size",
    "tensor-parallel-size": "engines.tp_size",
    "base-gpu-id": "engines.gpu_ids",
    "api-key": "engines.api_key",
}
ENGINE_DTYPES = ("", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig(_Section):
    _section: ClassVar[str] = "engines"

    backend: str = "local"
    """local (built-in engine server, CPU or one GPU) | sglang (launched here) | attach (already running at urls)."""
    num_engines: int = 1
    """Engine servers to launch (local|sglang); with attach, the length of urls."""
    urls: List[str] = field(default_factory=list)
    """Base URLs of running engines (attach only), e.g. http://node3:30000."""
    host: str = "127.0.0.1"
    """Interface launched engines bind to."""
    base_port: int = 30000
    """Port of engine 0; engine i listens on base_port + i."""
    tp_size: int = 1
    """Tensor-parallel GPUs per engine (sglang/attach; must be 1 for local)."""
    gpu_ids: List[int] = field(default_factory=list)
    """GPUs for launched sglang engines, num_engines × tp_size of them, engine i taking the i-th
    block; empty = the GPUs after the trainer's local ranks."""
    max_inflight_per_engine: int = 64
    """Requests the scheduler keeps in flight per engine (queue-scheduling slots)."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for an engine's /health after launch."""
    request_timeout_s: float = 600.0
    """Seconds before one HTTP request to an engine is abandoned."""
    server_args: Dict[str, Any] = field(default_factory=dict)
    """Extra SGLang flags, passed verbatim as --key value (e.g. {mem-fraction-static: 0.8})."""
    api_key: Optional[str] = None
    """Bearer token for the engines' HTTP API; null = none. Redacted when a config is printed."""
    dtype: str = ""
    """The engines' weight dtype (float32|bfloat16|float16): e.g. bfloat16 engines for an fp32 trainer, as
    on GPUs; every push is then cast by the trainer (half the bytes). Launched engines get it as --dtype
    (and so do the engines the multi-node template starts, through launch/pretrain_async_rl.py
    --print-engine-flags); other attached servers must have been started with it (an engine that reports
    another dtype in /get_server_info gets no deltas). "" = what the engines load by themselves
    (engines.server_args.dtype when set; the local engine's float32, SGLang's checkpoint dtype
    otherwise): pushes go in the trainer's dtype and the engines cast; delta pushes read it from each engine."""
    colocate: bool = False
    """Engines share the trainer's GPUs, time-shared: before each train step the engines are paused
    and release their memory (weights, KV cache, CUDA graphs: SGLang's /release_memory_occupation;
    launched SGLang engines get --enable-memory-saver), after it they take the weights back, receive
    the new ones, then the KV cache, and generate again. Needs async_rl.alpha=0."""
    max_restarts: int = 3
    """Launched engines (local|sglang) that exit are started again up to this many times each, then
    synced to the trainer's weights at the next push before they serve; 0 = never. Attached engines
    are not started here (the multi-node template's launch/slurm/engine_loop.sh restarts them on their
    node); they are watched instead (attach_probe_*)."""
    down_timeout_s: float = 600.0
    """The rollout side stops the run with an error (every rank saves what training reached) when no
    engine request has succeeded for this long, e.g. every engine down and none restarted."""
    attach_probe_interval_s: float = 2.0
    """backend=attach: seconds between /health probes of each attached engine."""
    attach_probe_failures: int = 3
    """backend=attach: this many failed /health probes in a row (5 s timeout each) take the engine out of
    routing; when it answers again it is synced at the next push and re-admitted."""

    min_engines: int = 1
    """The run goes on while at least this many engines are healthy; below it no request is dispatched
    (the rollout waits for engines to come back or join) and after engines.down_timeout_s the run stops
    with one line naming every engine and why it is out. At most engines.num_engines (the start)."""
    join_port: int = 0
    """> 0: engines may join this run while it trains, and leave it (rollout/fleet.py; docs/cluster.md
    "An elastic rollout fleet"): trainer rank 0 serves registration on this port, authenticated with
    engines.api_key. 0 = the fleet is the engines the run starts with."""
    join_host: str = "127.0.0.1"
    """Interface the registration endpoint binds; `node` = this node's address (multi-node template)."""
    join_address_file: str = ""
    """Where the endpoint's URL is written for workers to find (launch/fleet_worker.py); "" = {run_dir}/fleet.json."""

    def validate(self) -> None:
        self._one_of("backend", ENGINE_BACKENDS)
        self._at_least("min_engines", 1)
        self._require(self.min_engines <= self.num_engines, "min_engines",
                      f"must be <= engines.num_engines={self.num_engines}: the run starts with the engines it has")
        self._require(0 <= self.join_port <= 65535, "join_port", "must be a port in 1..65535, or 0 (no joins)")
        if not self.join_port:  # no registration endpoint: its settings would do nothing
            self._require(self.join_host == "127.0.0.1", "join_host", "is only used with engines.join_port > 0")
            self._require(not self.join_address_file, "join_address_file", "is only used with engines.join_port > 0")
        if self.join_port:
            self._require(bool(self.api_key), "join_port", "needs engines.api_key: registration is authenticated "
                          "with the run's key, and the engines that join must require it too")
            self._require(not self.colocate, "join_port", "cannot be used with engines.colocate=true (engines "
                          "from other hosts cannot share the trainer's GPUs)")
            self._require(bool(self.join_host), "join_host", "must be a host name, an address, or `node`")
        self._one_of("dtype", ENGINE_DTYPES)
        if self.dtype:
            self._require(not any(str(k).lstrip("-").replace("_", "-") == "dtype" for k in self.server_args),
                          "server_args", f"must not set dtype when engines.dtype={self.dtype} (one source)")

        self._at_least("max_restarts", 0)
        self._positive("attach_probe_interval_s")
        self._at_least("attach_probe_failures", 1)
        self._at_least("num_engines", 1)
        self._at_least("tp_size", 1)
        self._at_least("max_inflight_per_engine", 1)
        self._positive("startup_timeout_s")
        self._positive("request_timeout_s")
        self._positive("down_timeout_s")
        self._require(bool(self.host), "host", "must be a non-empty host name")
        self._require(1 <= self.base_port and self.base_port + self.num_engines - 1 <= 65535,
                      "base_port", f"must leave room for engines.num_engines={self.num_engines} ports "
                      "in 1..65535")
        if self.backend == "attach":
            self._require(len(self.urls) > 0, "urls", "must list the engine URLs when engines.backend=attach")
            self._require(len(self.urls) == self.num_engines, "num_engines",
                          f"must equal len(engines.urls)={len(self.urls)} when engines.backend=attach "
                          "(set both)")
            # Attached servers were started elsewhere: launch settings here would silently do nothing.
            self._require(not self.gpu_ids, "gpu_ids", "must be empty with engines.backend=attach")
            self._require(not self.server_args, "server_args",
                          "must be empty with engines.backend=attach (pass flags where the servers start)")
        else:
            self._require(not self.urls, "urls", "is only used with engines.backend=attach")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engines.urls entries must start with http:// or https://, got {url!r}")
        if self.backend == "local":
            self._require(self.tp_size == 1, "tp_size", "must be 1 with engines.backend=local")
            self._require(not self.gpu_ids, "gpu_ids", "must be empty with engines.backend=local")
        if self.backend == "sglang" and self.gpu_ids:
            self._require(len(self.gpu_ids) == self.num_engines * self.tp_size, "gpu_ids",
                          f"must hold engines.num_engines × engines.tp_size = "
                          f"{self.num_engines * self.tp_size} GPU ids")
        for key in self.server_args:
            flag = str(key).lstrip("-").replace("_", "-")
            if flag in _ENGINE_OWNED_FLAGS:
                raise ValueError(f"engines.server_args.{key} is set from {_ENGINE_OWNED_FLAGS[flag]}; "
                                 "remove it from engines.server_args")
