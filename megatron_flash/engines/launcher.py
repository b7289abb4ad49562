"""Start engine servers as child processes (SGLang or our local engine server), or attach to running ones.

    launcher = EngineLauncher.from_config(cfg.engines, model_path=cfg.model.hf_path, run_dir=run_dir)
    with launcher:                       # start(): spawn, wait for every /health; stop() on exit
        urls = launcher.urls             # http://127.0.0.1:30000, http://127.0.0.1:30001, ...

What one engine gets (backend sglang, engine i, tp_size t):
    CUDA_VISIBLE_DEVICES=<gpu_ids[i*t:(i+1)*t]> python -m sglang.launch_server --model-path M
        --host H --port base_port+i --tp-size t [--api-key K] <server_args as flags>
backend local runs ``python -m megatron_flash.engines.local_server`` with the same flags minus --tp-size;
backend attach starts nothing and only waits for the given URLs' /health. ``EngineCommand`` is the
one place a command line is made, so another server (e.g. a test dummy) plugs in the same way.

``server_args`` pass through verbatim (SGLang's own flag names, ``_`` or ``-``): True → bare flag,
False/None → omitted, a list → the flag once followed by every item (SGLang declares list flags
with nargs="+", so a repeated flag would keep only its last value), a dict → one JSON argument.

Each server's stdout+stderr go to ``<run_dir>/engines/engine_<i>.log`` (first line: the command,
API key redacted). Start-up waits for HTTP 200 on /health until ``startup_timeout_s``; a server
that exits first, or the deadline, raises ``EngineStartupError`` with the log's tail, after
stopping every server this launcher started. Servers run in their own process groups and are
stopped group-wide (SIGTERM, then SIGKILL after ``stop_grace_s``) by ``stop()``, at interpreter
exit (atexit), and on SIGTERM/SIGHUP to this process (handlers installed once, from the main thread,
chaining to the previous handler). Each server also gets SIGTERM from the kernel when this process
dies (parent-death signal), so a ``kill -9`` of the trainer leaves no engine behind (that plumbing,
and the /health probe, are in launcher_processes.py). The pid of engine i is in
``<run_dir>/engines/engine_<i>.pid``.

Restarts: ``supervise(max_restarts=k)`` starts a thread that polls the servers; one that
exits is reported through ``on_down(url, reason)`` (the rollout side takes it out of routing at
once), started again with the same command, and once its /health answers it is listed by
``take_restarted()`` — it then holds the checkpoint's weights, not the trainer's, so the caller
syncs it before routing to it (the proxy re-admits an engine only at the fleet's weight version).
``restarts`` records each one: exit code and seconds from noticing the exit (within ``interval_s``)
to a healthy server. After k restarts of
one engine it stays down.

Attached servers (backend attach: started elsewhere, e.g. by ``srun`` on engine nodes, whose
``launch/slurm/engine_loop.sh`` starts a server again when it exits) are watched instead:
``supervise`` polls their /health; ``down_after`` failed probes in a row (each ``probe_timeout_s``)
report the engine through ``on_down``, and once /health answers again it is listed by
``take_restarted()`` (``restarts``: exit_code None, restart_s = down noticed → healthy) to be synced
and re-admitted like a relaunched one. Nothing is started here, and an attached engine is never
given up on.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_flash.engines.launcher_processes import (die_with_parent, group_alive, log_tail, probe_health,
                                                       signal_group, stop_at_exit)

BACKENDS = ("local", "sglang", "attach")


class EngineStartupError(RuntimeError):
    """An engine server did not come up: exited early or missed the start-up deadline."""


def server_args_to_flags(server_args: Mapping[str, Any]) -> List[str]:
    """{"mem_fraction_static": 0.8, "disable-cuda-graph": True, "cuda-graph-bs": [1, 2]} →
    ["--mem-fraction-static", "0.8", "--disable-cuda-graph", "--cuda-graph-bs", "1", "2"]."""
    argv: List[str] = []
    for key, value in server_args.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if value:
                argv += [flag] + [str(v) for v in value]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def engine_server_args(config: Any, *, backend: str, return_routed_experts: bool = False,
                       lora_adapters: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The flags an engine server of `backend` gets for this run: `config.server_args` (an EngineConfig's)
    plus what the run needs of it (EngineLauncher.from_config says which)."""
    server_args = dict(config.server_args)
    if getattr(config, "dtype", ""):
        server_args["dtype"] = config.dtype  # validated: server_args holds no dtype of its own then
    if lora_adapters:
        server_args.setdefault("enable-lora", True)
        if backend == "sglang":
            server_args.setdefault("max-lora-rank", lora_adapters["rank"])
            server_args.setdefault("lora-target-modules", list(lora_adapters["target_modules"]))
    if config.colocate and backend == "sglang":
        server_args.setdefault("enable-memory-saver", True)  # else releasing memory frees nothing
    if return_routed_experts and backend == "sglang":
        server_args.setdefault("enable-return-routed-experts", True)  # else requests get no routes
    return server_args


@dataclass(frozen=True)
class EngineCommand:
    """How to start one engine server: the argv prefix plus which flags it understands."""

    prefix: Tuple[str, ...]
    tp_flag: Optional[str] = "--tp-size"
    """None for servers without tensor parallelism (they then require tp_size == 1)."""

    @classmethod
    def sglang(cls, python: str = sys.executable) -> "EngineCommand":
        return cls((python, "-m", "sglang.launch_server"))

    @classmethod
    def local(cls, python: str = sys.executable) -> "EngineCommand":
        return cls((python, "-m", "megatron_flash.engines.local_server"), tp_flag=None)

    @classmethod
    def for_backend(cls, backend: str, python: str = sys.executable) -> "EngineCommand":
        if backend == "sglang":
            return cls.sglang(python)
        if backend == "local":
            return cls.local(python)
        raise ValueError(f"no command for engine backend {backend!r} (known: sglang, local)")

    def build(self, *, model_path: str, host: str, port: int, tp_size: int = 1,
              api_key: Optional[str] = None, server_args: Optional[Mapping[str, Any]] = None) -> List[str]:
        argv = [*self.prefix, "--model-path", model_path, "--host", host, "--port", str(port)]
        if self.tp_flag is not None:
            argv += [self.tp_flag, str(tp_size)]
        elif tp_size != 1:
            raise ValueError(f"{' '.join(self.prefix)} has no tensor parallelism; tp_size must be 1, "
                             f"got {tp_size}")
        if api_key:
            argv += ["--api-key", api_key]
        return argv + server_args_to_flags(server_args or {})


@dataclass(frozen=True)
class EngineSpec:
    """Everything about one engine before it starts (printable: ``launcher.specs()``)."""

    index: int
    url: str
    argv: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set on top of this process's environment."""
    log_path: str = ""


def _client_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, host)


class EngineLauncher:
    """Start N engine servers (or attach to running ones) and stop them; see the module docstring."""

    def __init__(self, *, backend: str, model_path: str = "", num_engines: int = 1,
                 urls: Sequence[str] = (), host: str = "127.0.0.1", base_port: int = 30000,
                 tp_size: int = 1, gpu_ids: Sequence[int] = (), first_gpu: int = 0,
                 server_args: Optional[Mapping[str, Any]] = None, api_key: Optional[str] = None,
                 startup_timeout_s: float = 300.0, run_dir: str = ".",
                 command: Optional[EngineCommand] = None, env: Optional[Mapping[str, str]] = None,
                 stop_grace_s: float = 15.0, poll_interval_s: float = 0.5) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {'|'.join(BACKENDS)}, got {backend!r}")
        if backend == "attach":
            if not urls:
                raise ValueError("backend=attach needs urls, got none")
        elif not model_path:
            raise ValueError(f"backend={backend} needs model_path, got {model_path!r}")
        if gpu_ids and len(gpu_ids) != num_engines * tp_size:
            raise ValueError(f"gpu_ids must hold num_engines × tp_size = {num_engines * tp_size} ids, "
                             f"got {list(gpu_ids)}")
        self.backend = backend
        self.model_path = model_path
        self.num_engines = len(urls) if backend == "attach" else num_engines
        self._attach_urls = [u.rstrip("/") for u in urls]
        self.host = host
        self.base_port = base_port
        self.tp_size = tp_size
        self.gpu_ids = list(gpu_ids)
        self.first_gpu = first_gpu
        self.server_args = dict(server_args or {})
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.run_dir = run_dir
        self.command = command or (None if backend == "attach" else EngineCommand.for_backend(backend))
        self.env = dict(env or {})
        self.stop_grace_s = stop_grace_s
        self.poll_interval_s = poll_interval_s
        self._procs: List[Optional[subprocess.Popen]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: Optional[threading.Thread] = None
        self._restarted: List[str] = []
        self.gave_up: List[int] = []
        """Indexes of engines that exited after max_restarts restarts (they stay down)."""
        self.restarts: List[Dict[str, Any]] = []
        """One entry per restart: index, url, exit_code, restart_s (noticed → healthy), ok."""
        self._down: set[int] = set()  # noticed down and expected back (restarts left, or attached)

    @classmethod
    def from_config(cls, config: Any, *, model_path: str, run_dir: str, return_routed_experts: bool = False,
                    lora_adapters: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> "EngineLauncher":
        """From an ``EngineConfig``; kwargs (command, env, first_gpu, stop_grace_s) pass through.
        ``return_routed_experts``: the run replays MoE routes, so SGLang must record them.
        ``lora_adapters`` ({"rank": r, "target_modules": [...]}): LoRA adapters will be pushed by name,
        so the engines serve them (SGLang: up to this rank, on these modules)."""
        server_args = engine_server_args(config, backend=config.backend, return_routed_experts=return_routed_experts,
                                         lora_adapters=lora_adapters)
        return cls(backend=config.backend, model_path=model_path, num_engines=config.num_engines,
                   urls=config.urls, host=config.host, base_port=config.base_port, tp_size=config.tp_size,
                   gpu_ids=config.gpu_ids, server_args=server_args, api_key=config.api_key,
                   startup_timeout_s=config.startup_timeout_s, run_dir=run_dir, **kwargs)

    # -- plan -----------------------------------------------------------------------------------
    def specs(self) -> List[EngineSpec]:
        if self.backend == "attach":
            return [EngineSpec(index=i, url=u) for i, u in enumerate(self._attach_urls)]
        gpus = self.gpu_ids or list(range(self.first_gpu, self.first_gpu + self.num_engines * self.tp_size))
        specs = []
        for i in range(self.num_engines):
            port = self.base_port + i
            argv = self.command.build(model_path=self.model_path, host=self.host, port=port,
                                      tp_size=self.tp_size, api_key=self.api_key, server_args=self.server_args)
            env = dict(self.env)
            if self.backend == "sglang":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus[i * self.tp_size:(i + 1) * self.tp_size])
            specs.append(EngineSpec(index=i, url=f"http://{_client_host(self.host)}:{port}", argv=tuple(argv),
                                    env=env, log_path=os.path.join(self.run_dir, "engines", f"engine_{i}.log")))
        return specs

    @property
    def urls(self) -> List[str]:
        return [s.url for s in self.specs()]

    def _printable(self, argv: Sequence[str]) -> str:
        shown = ["<redacted>" if self.api_key and a == self.api_key else a for a in argv]
        return " ".join(shlex.quote(a) for a in shown)

    # -- start / stop ---------------------------------------------------------------------------
    def __enter__(self) -> "EngineLauncher":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> List[str]:
        """Spawn the servers (none for attach) and wait until every /health answers 200."""
        specs = self.specs()
        if self.backend != "attach":
            if self._procs:
                raise RuntimeError("this launcher's engines are already started; stop() them first")
            self._stopping.clear()
            stop_at_exit(self)
            os.makedirs(os.path.join(self.run_dir, "engines"), exist_ok=True)
            try:
                for spec in specs:
                    self._procs.append(self._spawn(spec))
            except BaseException:
                self.stop()
                raise
        try:
            self._wait_healthy(specs)
        except BaseException:
            self.stop()
            raise
        return [s.url for s in specs]

    def _spawn(self, spec: EngineSpec) -> subprocess.Popen:
        with open(spec.log_path, "ab") as log:
            env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
            log.write(f"# engine {spec.index}: {env_text} {self._printable(spec.argv)}\n".encode())
            log.flush()
            # Own session = own process group: stop() signals the server and everything it forked.
            # Parent-death signal: if this process dies without stopping them (kill -9, OOM), the
            # servers get SIGTERM from the kernel instead of living on as orphans.
            proc = subprocess.Popen(list(spec.argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **spec.env},
                                    start_new_session=True, preexec_fn=die_with_parent)
        pid_path = os.path.join(os.path.dirname(spec.log_path), f"engine_{spec.index}.pid")
        with open(pid_path + ".tmp", "w") as f:
            f.write(f"{proc.pid}\n")
        os.replace(pid_path + ".tmp", pid_path)
        return proc

    # -- restarts -------------------------------------------------------------------------------
    def supervise(self, *, max_restarts: int, on_down: Optional[Callable[[str, str], None]] = None,
                  interval_s: float = 0.5, down_after: int = 3, probe_timeout_s: float = 5.0) -> None:
        """Restart servers that exit, up to `max_restarts` times each; attached servers: watch their
        /health (`down_after` failed probes in a row = down) and report them when they answer again
        (see the module docstring). Call after `start()`. The thread is also the restarted servers'
        parent for the parent-death signal, so it lives until `stop()`."""
        if self._supervisor is not None:
            return
        if self.backend == "attach":
            if down_after < 1:
                raise ValueError(f"down_after must be >= 1, got {down_after}")
            self._stopping.clear()
            target, args = self._watch_attached, (on_down, interval_s, down_after, probe_timeout_s)
        elif max_restarts < 1:
            return
        else:
            target, args = self._supervise, (max_restarts, on_down, interval_s)
        self._supervisor = threading.Thread(target=target, args=args, name="engine-supervisor", daemon=True)
        self._supervisor.start()

    def _watch_attached(self, on_down: Optional[Callable[[str, str], None]], interval_s: float,
                        down_after: int, probe_timeout_s: float) -> None:
        specs = self.specs()
        misses = [0] * len(specs)
        down_since: List[Optional[float]] = [None] * len(specs)
        while not self._stopping.wait(interval_s):
            for spec in specs:
                if self._stopping.is_set():
                    return
                ok = probe_health(spec.url, api_key=self.api_key, timeout_s=probe_timeout_s)
                i = spec.index
                if ok and down_since[i] is not None:
                    entry = {"index": i, "url": spec.url, "exit_code": None,
                             "restart_s": time.monotonic() - down_since[i], "ok": True}
                    down_since[i] = None
                    with self._lock:
                        self.restarts.append(entry)
                        self._restarted.append(spec.url)
                        self._down.discard(i)
                    _log(f"engine {i} ({spec.url}) answers /health again after {entry['restart_s']:.1f} s: "
                         "it is synced and re-admitted at the next weight push")
                if ok:
                    misses[i] = 0
                    continue
                misses[i] += 1
                if misses[i] == down_after and down_since[i] is None:
                    down_since[i] = time.monotonic()
                    with self._lock:
                        self._down.add(i)
                    reason = (f"engine {i} ({spec.url}) failed {down_after} /health probes in a row "
                              f"({probe_timeout_s:g} s each, every {interval_s:g} s)")
                    _log(f"{reason}; out of service until it answers again (attached: restarted, if at all, "
                         "where it was started)")
                    if on_down is not None:
                        on_down(spec.url, reason)

    def coming_back(self) -> bool:
        """An engine is down now and expected back: a launched one that exited with restarts left (noticed
        by the supervisor or not yet), or an attached one that failed its probes and may answer again."""
        with self._lock:
            if self._down:
                return True
            if self.backend == "attach" or self._supervisor is None:  # nothing restarts a launched one
                return False
            return any(p is not None and p.poll() is not None and i not in self.gave_up
                       for i, p in enumerate(self._procs))

    def take_restarted(self) -> List[str]:
        """URLs of engines restarted and healthy since the last call (they need the current weights)."""
        with self._lock:
            out, self._restarted = self._restarted, []
        return out

    def _supervise(self, max_restarts: int, on_down: Optional[Callable[[str, str], None]],
                   interval_s: float) -> None:
        specs = self.specs()
        count = [0] * len(specs)
        while not self._stopping.wait(interval_s):
            for spec in specs:
                with self._lock:
                    proc = self._procs[spec.index] if spec.index < len(self._procs) else None
                if proc is None or proc.poll() is None or spec.index in self.gave_up:
                    continue
                reason = f"engine {spec.index} ({spec.url}) exited with code {proc.returncode}"
                with self._lock:
                    self._down.add(spec.index)
                if on_down is not None:
                    on_down(spec.url, reason)
                if count[spec.index] >= max_restarts:
                    self.gave_up.append(spec.index)
                    with self._lock:
                        self._down.discard(spec.index)
                    _log(f"{reason}; it was restarted {count[spec.index]} times (engines.max_restarts): "
                         "it stays down")
                    continue
                count[spec.index] += 1
                self._restart(spec, proc, reason)

    def _restart(self, spec: EngineSpec, dead: subprocess.Popen, reason: str) -> None:
        t0 = time.monotonic()
        signal_group(dead.pid, signal.SIGKILL)  # whatever it forked goes with it
        _log(f"{reason}; restarting it (last lines of {spec.log_path}:\n{log_tail(spec.log_path, num_lines=5)})")
        with self._lock:
            if self._stopping.is_set():
                return
            proc = self._spawn(spec)
            self._procs[spec.index] = proc
        entry: Dict[str, Any] = {"index": spec.index, "url": spec.url, "exit_code": dead.returncode,
                                 "restart_s": None, "ok": False}
        deadline = t0 + self.startup_timeout_s
        while not self._stopping.is_set() and time.monotonic() < deadline and proc.poll() is None:
            if probe_health(spec.url, api_key=self.api_key, timeout_s=2.0):
                entry["restart_s"], entry["ok"] = time.monotonic() - t0, True
                break
            self._stopping.wait(self.poll_interval_s)
        with self._lock:
            self.restarts.append(entry)
            if entry["ok"]:
                self._restarted.append(spec.url)
                self._down.discard(spec.index)
        if entry["ok"]:
            _log(f"engine {spec.index} ({spec.url}) restarted: healthy after {entry['restart_s']:.1f} s")
        elif not self._stopping.is_set():
            _log(f"engine {spec.index} ({spec.url}) did not come back within {self.startup_timeout_s:g} s "
                 f"(startup_timeout_s); last lines of {spec.log_path}:\n{log_tail(spec.log_path)}")
            signal_group(proc.pid, signal.SIGKILL)  # the next poll counts it as exited again

    def _wait_healthy(self, specs: Sequence[EngineSpec]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(specs)
        while pending:
            for spec in list(pending):
                proc = self._procs[spec.index] if self._procs else None
                if proc is not None and proc.poll() is not None:
                    raise EngineStartupError(
                        f"engine {spec.index} ({spec.url}) exited with code {proc.returncode} during "
                        f"start-up; last lines of {spec.log_path}:\n{log_tail(spec.log_path)}")
                remaining = deadline - time.monotonic()
                if probe_health(spec.url, api_key=self.api_key, timeout_s=max(0.1, min(2.0, remaining))):
                    pending.remove(spec)
            if not pending:
                return
            if time.monotonic() >= deadline:
                parts = []
                for spec in pending:
                    where = f"; last lines of {spec.log_path}:\n{log_tail(spec.log_path)}" if spec.log_path else ""
                    parts.append(f"engine {spec.index} ({spec.url}) not healthy after "
                                 f"{self.startup_timeout_s:g}s (startup_timeout_s){where}")
                raise EngineStartupError("\n".join(parts))
            time.sleep(self.poll_interval_s)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self._procs if p is not None]

    def stop(self) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after stop_grace_s. Idempotent."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=10.0)
        self._supervisor = None
        with self._lock:
            procs = [p for p in self._procs if p is not None]
            self._procs = []
        if not procs:
            return
        for proc in procs:
            signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in procs:
            while time.monotonic() < deadline and (proc.poll() is None or group_alive(proc.pid)):
                time.sleep(0.05)
        for proc in procs:
            signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
                pass


def _log(message: str) -> None:
    logging.getLogger(__name__).warning(message)
