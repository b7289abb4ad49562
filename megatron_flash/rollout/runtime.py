"""The rollout side as one object the controller starts and stops: engines (launched or attached),
the proxy, the scheduler and the reward pool, all on one asyncio loop in a background thread of
rank 0. The trainer thread talks to it only through the SampleBuffer, the StalenessManager and the
thread-safe methods here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_flash.buffer.sample_buffer import SampleBuffer
from megatron_flash.buffer.staleness import StalenessManager
from megatron_flash.rollout.filters import get_filter
from megatron_flash.rollout.group_dump import GroupDump
from megatron_flash.rollout.group_runner import GroupRunner, GroupRunnerFactory
from megatron_flash.rollout.scheduler import RolloutScheduler, RolloutStats, SchedulerSettings
from megatron_flash.trace import ACTIVITY, TRACER
from megatron_flash.types import Group

if TYPE_CHECKING:
    from megatron_flash.config.schema import EngineConfig, RolloutConfig

logger = logging.getLogger(__name__)


def sampling_params(rollout_cfg: Any) -> dict[str, Any]:
    """Engine sampling params from the rollout section (SGLang names)."""
    params = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p, "top_k": rollout_cfg.top_k}
    if rollout_cfg.min_new_tokens:
        params["min_new_tokens"] = rollout_cfg.min_new_tokens
    return params


class RolloutRuntime:
    """`start_engines()` (blocks until they are healthy), then `start_rollout()`; `stop()`.

    Gets the `engines` and `rollout` sections only; `dump_groups` writes every finished group to
    rollout.dump_path (or {run_dir}/groups.jsonl) even when that is not set; `return_routed_experts`
    asks the engines for MoE routes (the trainer replays them)."""

    def __init__(self, engines: "EngineConfig", rollout: "RolloutConfig", *, run_dir: str,
                 staleness: StalenessManager, buffer: SampleBuffer, dataset: Any, tokenizer: Any, model_path: str,
                 dump_groups: bool = False, group_runner_factory: Optional[GroupRunnerFactory] = None,
                 return_routed_experts: bool = False, spawns: Optional[bool] = None, distill: Any = None,
                 lora_adapters: Optional[dict] = None) -> None:
        self.engines_cfg, self.rollout_cfg = engines, rollout
        self.lora_adapters = lora_adapters
        """LoRA adapters pushed by name ({"rank", "target_modules"}): engines serve them, requests name them."""
        self.synced_version: Optional[int] = None
        """The version the engines got before rollout started (a resume, a start adapter)."""
        self.distill = distill if distill is not None and distill.enabled else None
        self.teacher_launcher: Any = None
        self.teacher_urls: list[str] = []
        self.return_routed_experts = return_routed_experts
        self.run_dir, self.staleness, self.buffer = run_dir, staleness, buffer
        staleness.observer = lambda event, n: TRACER.instant(event, "buffer", "buffer", samples=n,
                                                             version=staleness.version)
        self.dump_groups = dump_groups
        self.group_runner_factory = group_runner_factory
        self.dataset, self.tokenizer, self.model_path = dataset, tokenizer, model_path
        self.decode: Callable[[list[int]], str] = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.group_runner: Optional[GroupRunner] = None
        self.launcher: Any = None
        self.urls: list[str] = []
        self.scheduler: Optional[RolloutScheduler] = None
        self.dump: Optional[GroupDump] = None
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._proxy: Any = None
        self._teacher_proxy: Any = None
        self._reward_pool: Any = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._restore: Optional[dict[str, Any]] = None
        # rollout.runner=process: the loop runs in a RolloutProcess, which builds a runtime of its own
        # (spawns=False) there; `buffer` and `staleness` then become its stubs once rollout starts.
        self.spawns = rollout.runner == "process" if spawns is None else spawns
        self._remote: Any = None
        self.registry: Any = None
        """engines.join_port: the fleet's registration endpoint (rollout/fleet.py), trainer rank 0."""

    # ------------------------------------------------------------------ lifecycle
    def start_engines(self) -> list[str]:
        """Launch (or attach) the engines and wait until they are healthy."""
        from megatron_flash.engines.launcher import EngineLauncher

        # Launched GPU engines default to the GPUs after this node's trainer ranks (engines.gpu_ids).
        eng = self.engines_cfg
        first_gpu = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if eng.backend == "sglang" else 0
        self.launcher = EngineLauncher.from_config(eng, model_path=self.model_path, run_dir=self.run_dir,
                                                   lora_adapters=self.lora_adapters,
                                                   first_gpu=first_gpu,
                                                   return_routed_experts=self.return_routed_experts)
        self.urls = self.launcher.start()
        if eng.backend == "attach":  # started elsewhere: watch /health, re-admit when it answers again
            self.launcher.supervise(max_restarts=0, on_down=self.engine_down, interval_s=eng.attach_probe_interval_s,
                                    down_after=eng.attach_probe_failures)
        elif eng.max_restarts > 0:
            self.launcher.supervise(max_restarts=eng.max_restarts, on_down=self.engine_down)
        if self.distill is not None:
            self._start_teacher(first_gpu + eng.num_engines * eng.tp_size)
        if eng.join_port:
            from megatron_flash.rollout.fleet import FleetRegistry

            self.registry = FleetRegistry(
                api_key=eng.api_key or "", tp_size=eng.tp_size, own_urls=self.urls, host=eng.join_host,
                port=eng.join_port, address_file=eng.join_address_file or os.path.join(self.run_dir, "fleet.json"),
                probe_interval_s=eng.attach_probe_interval_s, probe_failures=eng.attach_probe_failures,
                on_leave=self.fleet_remove)
            self.registry.start()
        return self.urls

    def teacher_engines_cfg(self) -> Any:
        """The teacher's engine settings: the student's, with the teacher's count, ports and flags
        (launched on the student's backend), or attached at distill.urls."""
        d = self.distill
        if d.urls:
            return dataclasses.replace(self.engines_cfg, backend="attach", urls=list(d.urls), num_engines=len(d.urls),
                                       server_args={}, gpu_ids=[])
        return dataclasses.replace(self.engines_cfg, num_engines=d.num_engines, base_port=d.base_port,
                                   server_args=dict(d.server_args), gpu_ids=[], urls=[])

    def _start_teacher(self, first_gpu: int) -> None:
        from megatron_flash.engines.launcher import EngineLauncher

        cfg = self.teacher_engines_cfg()
        self.teacher_launcher = EngineLauncher.from_config(cfg, model_path=self.distill.teacher,
                                                           run_dir=os.path.join(self.run_dir, "teacher"),
                                                           first_gpu=first_gpu)
        self.teacher_urls = self.teacher_launcher.start()
        if cfg.backend != "attach" and cfg.max_restarts > 0:
            self.teacher_launcher.supervise(max_restarts=cfg.max_restarts, on_down=self.teacher_down)
        logger.info("teacher engines up: %s (%s)", self.teacher_urls, self.distill.teacher)

    def teacher_down(self, url: str, reason: str) -> None:
        loop, proxy = self._loop, self._teacher_proxy
        if loop is not None and proxy is not None and loop.is_running():
            loop.call_soon_threadsafe(proxy.take_out, url, reason)

    def engine_context(self) -> Optional[int]:
        """The smallest context (prompt + response tokens) the engines report in /get_server_info
        (`context_length`), or None when none reports one (then refusals are handled per request)."""
        from megatron_flash.engines.client import EngineClient

        async def ask(url: str) -> Any:
            async with EngineClient(url, api_key=self.engines_cfg.api_key, max_retries=1) as client:
                return (await client.server_info()).get("context_length")

        async def every() -> list:
            return await asyncio.gather(*(ask(u) for u in self.urls), return_exceptions=True)

        known = [v for v in asyncio.run(every()) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return min(known) if known else None

    def fit_prompts_to_engines(self, max_new_tokens: int) -> int:
        """Drop the prompts that can never fit the engines (prompt + max_new_tokens > their smallest
        context), so none is sent only to be refused; returns how many. Raises ValueError when none fits."""
        context = self.engine_context()
        if context is None:
            return 0
        why = f"the engines' context of {context} tokens with rollout.max_new_tokens={max_new_tokens}"
        if context - max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt in {why}")
        dropped = self.dataset.drop_longer_than(context - max_new_tokens, why=why)
        if dropped:
            logger.warning("%d prompt(s) longer than %d tokens skipped at load: they cannot fit %s",
                           dropped, context - max_new_tokens, why)
        return dropped

    def engine_down(self, url: str, reason: str) -> None:
        """From the launcher's supervisor thread: stop routing to `url` now (its requests are retried
        elsewhere); it comes back only at the fleet's weight version (after the next push)."""
        if self._remote is not None:
            self._remote.engine_down(url, reason)
            return
        loop, proxy = self._loop, self._proxy
        if loop is not None and proxy is not None and loop.is_running():  # not one that left the fleet
            loop.call_soon_threadsafe(lambda: proxy.take_out(url, reason) if url.rstrip("/") in proxy.urls else None)

    def take_restarted(self) -> tuple[list[str], list[float]]:
        """Engines restarted since the last call (URLs) and their restart seconds."""
        if self.launcher is None:
            return [], []
        urls = self.launcher.take_restarted()
        seconds = [r["restart_s"] for r in self.launcher.restarts if r["ok"] and r["url"] in urls]
        return urls, seconds[-len(urls):] if urls else []

    def wait_restarted(self, *, timeout_s: float) -> tuple[list[str], list[float]]:
        """A weight push found no engine in service: wait until one that is down comes back (launched:
        restarted by the supervisor; attached: answering again) and return it as `take_restarted` does;
        ([], []) when none is down and expected back (after the time it takes to see one as down), or at
        timeout_s. Without this, one killed engine of a single-engine run ended the run."""
        if self.launcher is None:
            return [], []
        eng = self.engines_cfg
        # Time to see an engine as down: an engine killed during the push can close its sockets (the
        # push fails) before it has exited (the launcher sees it alive): the soak met that race.
        notice_s = eng.attach_probe_interval_s * (eng.attach_probe_failures + 1) if eng.backend == "attach" else 2.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            back = self.take_restarted()
            if back[0]:
                return back
            if not self.launcher.coming_back() and time.monotonic() - t0 >= notice_s:
                return [], []
            time.sleep(0.1)
        return [], []

    def start_rollout(self, restore: Optional[dict[str, Any]] = None) -> None:
        """Start the rollout thread (after the engines hold the right weights); `restore` is a
        `snapshot()` from a checkpoint: the scheduler continues from it before admitting anything."""
        if self.spawns:
            self._start_process(restore)
            return
        self._restore = restore
        if self.rollout_cfg.dump_path or self.dump_groups:
            self.dump = GroupDump(self.rollout_cfg.dump_path or os.path.join(self.run_dir, "groups.jsonl"))
        self._thread = threading.Thread(target=self._thread_main, name="rollout", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.stop()
            raise self._error

    def _start_process(self, restore: Optional[dict[str, Any]]) -> None:
        from megatron_flash.rollout.process import RolloutProcess

        if self.group_runner_factory is not None:
            raise ValueError("rollout.runner=process runs single-turn rollout only (agentic episodes need thread)")
        spec = {
            "engines": self.engines_cfg, "rollout": self.rollout_cfg, "run_dir": self.run_dir, "dataset": self.dataset,
            "tokenizer": self.tokenizer, "model_path": self.model_path, "urls": self.urls,
            "dump_groups": self.dump_groups, "return_routed_experts": self.return_routed_experts,
            "alpha": self.staleness.alpha, "batch_size": self.staleness.batch_size, "extra": self.staleness.extra,
            "admission": self.staleness.admission, "min_lookahead": self.staleness.min_lookahead,
            "version": self.staleness.version, "counters": self.staleness.snapshot(),
            "stale_policy": self.buffer.stale_policy, "restore": restore, "parent_pid": os.getpid(),
            "trace": TRACER.enabled, "distill": self.distill, "teacher_urls": self.teacher_urls,
            "lora_adapters": self.lora_adapters, "synced_version": self.synced_version}
        self._remote = RolloutProcess(spec, build_in_child)
        self.buffer, self.staleness = self._remote.buffer, self._remote.staleness

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - the buffer already carries it to the trainer
            logger.error("rollout side stopped: %s", e)
            self._error = e
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from megatron_flash.rewards import RewardPool
        from megatron_flash.rollout.proxy import LLMProxy

        r = self.rollout_cfg
        self._loop = asyncio.get_running_loop()
        reward_pool = RewardPool(r.reward, num_workers=r.reward_workers, timeout_s=r.reward_timeout_s)
        self._reward_pool = reward_pool
        try:
            group_filter = get_filter(r.dynamic_filter)
            async with contextlib.AsyncExitStack() as stack:
                proxy = await stack.enter_async_context(LLMProxy.from_config(
                    self.engines_cfg, self.urls, names_adapters=self.lora_adapters is not None))
                if self.synced_version is not None:  # before any request: which weights (adapter) to name
                    proxy.note_external_sync(str(self.synced_version))
                self._proxy = proxy
                proxy.set_min_engines(self.engines_cfg.min_engines)
                teacher = None
                if self.distill is not None:
                    from megatron_flash.rollout.teacher import TeacherScorer

                    self._teacher_proxy = await stack.enter_async_context(
                        LLMProxy.from_config(self.teacher_engines_cfg(), self.teacher_urls, trace_name="teacher"))
                    teacher = TeacherScorer(self._teacher_proxy, top_k=self.distill.topk)
                settings = SchedulerSettings(
                    n_samples_per_prompt=r.n_samples_per_prompt, sampling_params=sampling_params(r),
                    max_new_tokens=r.max_new_tokens, prompt_replication=r.prompt_replication,
                    replication_chunk=r.replication_chunk, max_resumes=r.max_resumes,
                    engine_down_deadline_s=self.engines_cfg.down_timeout_s,
                    return_routed_experts=self.return_routed_experts, overlong_buffer_len=r.overlong_buffer_len,
                    overlong_penalty=r.overlong_penalty, max_prompt_retries=r.max_prompt_retries)
                self.scheduler = RolloutScheduler(
                    dataset=self.dataset, proxy=proxy, reward_pool=reward_pool, group_filter=group_filter,
                    buffer=self.buffer, staleness=self.staleness, settings=settings, decode=self.decode,
                    teacher=teacher)
                if self.dump is not None:
                    self.scheduler.on_group = self.dump.write
                if self.group_runner_factory is not None:
                    self.group_runner = self.group_runner_factory(proxy, lambda: self.staleness.version)
                    self.scheduler.group_runner = self.group_runner
                    self.group_runner.rollout_stats = self.scheduler.stats
                if self._restore is not None:
                    self.scheduler.restore(self._restore["scheduler"])
                self._ready.set()
                await self.scheduler.run()
        finally:
            reward_pool.close()

    def stop(self) -> None:
        if self.registry is not None:
            self.registry.stop()
        if self._remote is not None:
            if TRACER.enabled:  # the rollout process's last events
                try:
                    TRACER.add(self._remote.call("runtime", "take_activity")[3])
                except Exception as e:  # noqa: BLE001 - a trace never stops a run
                    logger.warning("rollout process trace events lost: %s", e)
            self._remote.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.launcher is not None:
            self.launcher.stop()
        if self.teacher_launcher is not None:
            self.teacher_launcher.stop()
        if self.dump is not None:
            self.dump.close()
            self.dump = None

    # ------------------------------------------------------------------ thread-safe views
    def snapshot(self) -> dict[str, Any]:
        """Rollout state for a checkpoint, taken on the loop thread (nothing moves meanwhile).
        In-flight work is not saved: its prompts are, and are generated again after a resume."""
        if self._remote is not None:
            return self._remote.call("runtime", "snapshot")

        async def snap() -> dict[str, Any]:
            return {"scheduler": self.scheduler.snapshot(), "buffer": self.buffer.snapshot()}

        return asyncio.run_coroutine_threadsafe(snap(), self._loop).result(timeout=60)

    def evaluate(self, sets: Any, settings: Any) -> tuple[dict[str, float], list[dict]]:
        """Held-out evaluation on the rollout loop, beside the rollout (same proxy, same reward pool);
        blocks the caller until done (rollout/evaluation.py)."""
        from megatron_flash.rollout.evaluation import evaluate

        if self._remote is not None:
            return self._remote.call("runtime", "evaluate", sets, settings)
        if self._loop is None or self._proxy is None or not self._loop.is_running():
            raise RuntimeError("evaluation needs the rollout loop running (start_rollout first)")
        return asyncio.run_coroutine_threadsafe(
            evaluate(self._proxy, sets, self._reward_pool, self.decode, settings), self._loop).result()

    def requeue(self, group: Group) -> None:
        if self._remote is not None:
            self._remote.call("runtime", "requeue", group)
        elif self.scheduler is not None:
            self.scheduler.requeue_prompt(group)

    def note_sync(self, version: int, failed: dict[str, str], joined: tuple[str, ...] = ()) -> None:
        """After a push: the proxy learns the fleet version and stops routing to failed engines, and
        routes to the engines that `joined` with this push (they hold it and passed the probe)."""
        if self._remote is not None:
            self._remote.call("runtime", "note_sync", version, failed, tuple(joined))
            return
        if self._loop is None or self._proxy is None or not self._loop.is_running():
            return
        eng = self.engines_cfg

        async def note() -> None:
            self._proxy.note_external_sync(str(version), failed=failed)
            for url in joined:
                if url not in self._proxy.urls:
                    self._proxy.add_engine(url, api_key=eng.api_key, request_timeout_s=eng.request_timeout_s)

        asyncio.run_coroutine_threadsafe(note(), self._loop).result(timeout=30)

    def fleet_remove(self, url: str, why: str) -> int:
        """An engine left the fleet (rollout/fleet.py): no request goes to it again, and the ones it was
        serving go to other engines; returns how many. Any thread."""
        if self._remote is not None:
            return self._remote.call("runtime", "fleet_remove", url, why)
        if self._loop is None or self._proxy is None or not self._loop.is_running():
            return 0

        async def remove() -> int:
            return self._proxy.remove_engine(url, why)

        return asyncio.run_coroutine_threadsafe(remove(), self._loop).result(timeout=30)

    def fleet_metrics(self) -> dict[str, float]:
        """engines_joined / engines_left / requests_reissued (since the start) and the fleet size."""
        return {} if self.registry is None else self.registry.take_counts()

    def take_metrics(self) -> tuple[RolloutStats, dict[str, float]]:
        """This window's rollout counters and the proxy's engine metrics; starts a new window."""
        if self._remote is not None:  # its engine_restarts are the launcher's, which lives here
            stats, engine = self._remote.call("runtime", "take_metrics")
            if engine and self.launcher is not None:
                engine["engine_restarts"] = float(len(self.launcher.restarts))
            return stats, {**engine, **self.fleet_metrics()} if engine else engine
        if self._loop is None or self.scheduler is None or not self._loop.is_running():
            return RolloutStats(), {}

        async def snap() -> tuple[RolloutStats, dict[str, float]]:
            stats = self.scheduler.stats.take()
            m = self._proxy.metrics()
            self._proxy.reset_metrics()
            idle = [e.idle_fraction for e in m.engines if e.healthy]
            out = {"engine_idle_frac": sum(idle) / len(idle) if idle else 1.0,
                   "engines_healthy": float(sum(e.healthy for e in m.engines)), "proxy_retried": float(m.retried),
                   "fleet_size": float(len(m.engines)), "proxy_reissued": float(m.reissued), **self.fleet_metrics(),
                   "engine_restarts": float(len(self.launcher.restarts) if self.launcher is not None else 0)}
            for i, e in enumerate(m.engines):  # requests each engine completed this window
                out[f"engine{i}_requests"] = float(e.completed)
            # On this loop, so the trace puts exactly the requests this window counts before it.
            TRACER.instant("metrics window", "rollout", "rollout", **{k: v for k, v in out.items() if "requests" in k})
            if self.group_runner is not None:
                out.update(self.group_runner.stats.take().as_metrics())
            return stats, out

        try:
            return asyncio.run_coroutine_threadsafe(snap(), self._loop).result(timeout=10)
        except Exception as e:  # metrics must never stop training
            logger.warning("rollout metrics unavailable: %s", e)
            return RolloutStats(), {}


    def take_activity(self) -> tuple[list[tuple[int, int]], list[int], int, list]:
        """The engine requests' in-flight intervals since the last call, the starts of those still in
        flight and the time now, in ns (`trace.ACTIVITY`); and the trace events of a rollout process."""
        if self._remote is not None:
            return self._remote.call("runtime", "take_activity")
        done, open_starts, now = ACTIVITY.take()
        return done, open_starts, now, TRACER.drain() if TRACER.forwarding else []


def build_in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside the rollout process (rollout/process.py): from the `spec` that `_start_process` wrote, its
    own StalenessManager, SampleBuffer and a thread-mode RolloutRuntime, the rollout started."""
    staleness = StalenessManager(alpha=spec["alpha"], batch_size=spec["batch_size"], extra=spec["extra"],
                                 admission=spec["admission"], min_lookahead=spec["min_lookahead"])
    staleness.set_version(spec["version"])
    if spec.get("trace"):  # events go to the trainer's trace with each step's take_activity
        TRACER.forward()
    holder: dict[str, Any] = {}
    regenerate = spec["stale_policy"] == "regenerate"
    buffer = SampleBuffer(staleness, stale_policy=spec["stale_policy"],
                          on_evict=lambda g: holder["runtime"].requeue(g) if regenerate else None)
    restore = spec["restore"]
    if restore is not None:
        buffer.restore(restore["buffer"])
    staleness.counters = spec["counters"]  # the trainer's, which already count the restored groups
    runtime = RolloutRuntime(spec["engines"], spec["rollout"], run_dir=spec["run_dir"], staleness=staleness,
                             buffer=buffer, dataset=spec["dataset"], tokenizer=spec["tokenizer"],
                             model_path=spec["model_path"], dump_groups=spec["dump_groups"],
                             return_routed_experts=spec["return_routed_experts"], spawns=False,
                             distill=spec["distill"], lora_adapters=spec["lora_adapters"])
    runtime.synced_version = spec["synced_version"]
    holder["runtime"] = runtime
    runtime.urls = list(spec["urls"])
    runtime.teacher_urls = list(spec["teacher_urls"])  # launched (and supervised) by the parent
    runtime.start_rollout(restore=restore)
    return {"runtime": runtime, "buffer": buffer, "staleness": staleness}
