"""The asynchronous RL loop: Megatron trains while the rollout side keeps generating.

    rank 0, rollout thread (asyncio)                         all ranks, main thread (Megatron)
    ────────────────────────────────                         ─────────────────────────────────
    dataset ─► admit group if capacity(V) ≥ n                 loop over steps k = V:
       │        (waits only for capacity: a consume            batch ◄─ buffer.take_batch(B)
       │         or a drop frees it)                              │ (rank 0 waits for B trainable
       ▼                                                          │  samples; broadcast to ranks)
    proxy ─► engines (HTTP; queue scheduling)                     ▼
       │        ▲ paused only during the push                  proximal logprobs (if the loss
       ▼        │                                               needs them) → advantages
    reward the moment a response ends                            ▼
       ▼                                                       epochs × mini-batches of the loss
    group complete ─► filter ─► SampleBuffer ──────────────►     ▼
                                                               push weights (pause → buckets →
                                                               resume), V ← V + 1  (frees capacity)

Who waits for whom: the rollout thread waits only for capacity (staleness.py: at most
(L + 1)·B + extra samples in flight or buffered beyond what was consumed, the lookahead L ≤ α — a
fraction of a batch by default — raised only while the trainer waits for rollout); the trainer waits only
for a full batch of samples with V − start ≤ α (older ones are evicted: dropped or regenerated).
Engines pause only while weights move. α = 0 degenerates to synchronous training.

Modes (trainer.mode): full | rollout_only (groups dumped, nothing trained) | train_only (groups
replayed from a dump, no engines); what each does is the `ModeTraits` table of config/schema.py.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron_flash import recipes
from megatron_flash.buffer.sample_buffer import BufferClosed, SampleBuffer
from megatron_flash.buffer.staleness import StalenessManager, staleness
from megatron_flash.config.schema import RUN_MODES
import megatron_flash.controller.assembly as assembly  # not via the package __init__, which imports us
from megatron_flash.controller.checkpoints import Checkpoints, install_sigterm_flag
from megatron_flash.controller.engine_handoff import EngineHandoff
from megatron_flash.controller.step_metrics import StepRecorder, where_samples_went
from megatron_flash.memprobe import HeapTrim
from megatron_flash.trace import TRACER, TRAINER
from megatron_flash.types import Group, TrainBatch, collate

if TYPE_CHECKING:
    from megatron_flash.config.schema import RunConfig
    from megatron_flash.losses import Loss
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.tracking import Tracker
    from megatron_flash.trainer.policy import MegatronPolicy
    from megatron_flash.weight_sync.bridge import WeightBridge

logger = logging.getLogger(__name__)

HEAP_TRIM_INTERVAL_S = 30.0
"""How often (at most) the loop gives free heap pages back to the kernel: a trim costs milliseconds."""


class RolloutStopped(RuntimeError):
    """No batch can come (engines down past the deadline, data exhausted, ...): raised on every rank,
    so all of them save the policy before exiting."""


class Controller:
    def __init__(self, cfg: "RunConfig", *, loss: Optional["Loss"] = None) -> None:
        self.cfg = cfg
        self._loss = loss
        self.run_dir = cfg.logging.dir
        self.mode = RUN_MODES[cfg.trainer.mode]
        t = cfg.trainer
        self.batch_size = t.global_batch_size * t.num_mini_batches  # samples per train step
        self.version = 0
        self.policy: Optional["MegatronPolicy"] = None
        self.runtime: Optional["RolloutRuntime"] = None
        self.bridge: Optional["WeightBridge"] = None
        self.tracker: Optional["Tracker"] = None
        self.buffer: Optional[SampleBuffer] = None
        self.replay: list[Group] = []
        self.rank = 0
        self.start_step = 0
        self.preempted = False
        self._resume: Optional[dict[str, Any]] = None  # rank 0: the checkpoint's rollout state
        self._ctrl_group: Any = None
        self.evaluation: Any = None  # rank 0, with eval.datasets: rollout.evaluation.PeriodicEvaluation
        self._overlong: dict[str, int] = {}  # this step's overlong-filter counts (recipes.overlong_filter)
        self._nonfinite_run = 0  # optimizer steps skipped in a row for a non-finite gradient
        self._trained = False  # the policy's weights are one update ahead of self.version (push pending)
        self.version_check: Any = None  # trainer/version_check.VersionCheck, when trainer.version_check_interval
        self._check_metrics: dict[str, float] = {}
        self.checkpoints: Optional[Checkpoints] = None
        self.handoff: Optional[EngineHandoff] = None
        self.recorder: Optional[StepRecorder] = None
        self.heap_trim = HeapTrim(interval_s=HEAP_TRIM_INTERVAL_S)

    # ================================================================== the loop (one screen)
    def run(self) -> dict[str, Any]:
        self.setup()
        summary: dict[str, Any] = {}
        error: Optional[BaseException] = None
        try:
            for step in range(self.start_step, self.cfg.trainer.total_steps):
                t0 = time.monotonic()
                groups = self.next_batch()                                # rank 0 waits on the buffer
                t_wait = time.monotonic() - t0
                self.handoff.release(self.version)                        # colocated: engines sleep
                batch = self.make_batch(groups)                           # advantages, π_prox
                train_metrics = self.train(batch)                         # epochs × mini-batches
                self._trained = True
                t_train = time.monotonic() - t0 - t_wait
                sync_metrics = self.push_weights()                        # pause → send → resume; V += 1
                self._trained = False
                self.maybe_evaluate(step + 1)                             # held-out sets, at version V
                summary = self.log(step, groups, batch, train_metrics, sync_metrics, t_start=t0,
                                   t_wait=t_wait, t_train=t_train, t_step=time.monotonic() - t0)
                if self.checkpoints.maybe_save(step, version=self.version,  # every N steps; SIGTERM: save, stop
                                               rollout_state=self._rollout_state):
                    self.preempted = True
                    break
                self.heap_trim.maybe()                                    # freed native memory back to the OS
            else:
                self.maybe_evaluate(self.cfg.trainer.total_steps, final=True)
        except BaseException as e:
            error = e
            raise
        finally:
            self.shutdown(error)
        return summary

    # ================================================================== set-up / shutdown
    def setup(self) -> None:
        from megatron_flash.config import config_to_yaml

        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        torch.manual_seed(cfg.trainer.seed)
        self.loss, self.loss_fn = assembly.loss_fns(cfg.loss, self._loss, cfg.rollout.max_new_tokens, cfg.distill)
        loss_line = assembly.check_loss(cfg, self.loss)
        if os.environ.get("RANK", "0") == "0":  # the first line of the run: what each ratio is taken against
            logger.info("%s", loss_line)
            if cfg.distill.enabled and cfg.async_rl.alpha > 0 and not cfg.distill.topk:
                logger.warning("distill.teacher with async_rl.alpha=%d and distill.topk=0: the sampled-token reverse "
                               "KL collapsed on stale samples where it was measured (docs/distillation.md); "
                               "distill.topk > 0 (the teacher's top-K reverse KL) is the setting that learned at "
                               "alpha > 0", cfg.async_rl.alpha)
        self.staleness = StalenessManager(alpha=cfg.async_rl.alpha, batch_size=self.batch_size,
                                          extra=cfg.rollout.extra_prompts * cfg.rollout.n_samples_per_prompt,
                                          admission=cfg.async_rl.admission, min_lookahead=cfg.async_rl.min_lookahead)
        if self.mode.trains:
            self.policy = assembly.build_policy(cfg)
            self.rank = self.policy.layout.rank
            if cfg.trainer.version_check_interval and self.mode.generates:  # replayed labels name other runs' weights
                from megatron_flash.trainer.version_check import VersionCheck

                self.version_check = VersionCheck(self.policy, interval=cfg.trainer.version_check_interval,
                                                  alpha=cfg.async_rl.alpha,
                                                  mixed_after_push=cfg.rollout.pause_mode == "in_place")
            if self.policy.layout.world_size > 1:  # control messages (batches, stop) go over gloo
                # The other ranks wait here while rank 0 waits for a rollout batch: both deadlines.
                wait = cfg.parallel.collective_timeout_s + cfg.async_rl.batch_timeout_s
                self._ctrl_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait))
        self.checkpoints = Checkpoints(cfg.checkpoint, policy=self.policy, run_dir=self.run_dir, rank=self.rank,
                                       ctrl_group=self._ctrl_group, mode=self.mode)
        if self.mode.trains:
            self._maybe_resume()
        if self.rank == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                f.write(config_to_yaml(cfg))
        self.tokenizer = assembly.build_tokenizer(cfg.model.hf_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        from megatron_flash.tracking import Tracker

        self.tracker = Tracker(self.run_dir, cfg.logging, total_steps=cfg.trainer.total_steps,
                               config=assembly.config_dict(cfg), rank=self.rank)
        self.recorder = StepRecorder(run_dir=self.run_dir, tracker=self.tracker, rollout_cfg=cfg.rollout)
        if self.mode.replays:
            from megatron_flash.rollout.group_dump import read_group_dump

            self.replay = read_group_dump(cfg.trainer.replay_path)
        if self.mode.generates:
            self._start_generating()
        self.handoff = EngineHandoff(self.bridge, self.runtime, rank=self.rank, broadcast=self._broadcast,
                                     fleet=cfg.engines.join_port > 0)
        if self.mode.generates:
            self.maybe_evaluate(self.start_step)  # before training (or where a resumed run starts)
            install_sigterm_flag()  # after the launcher's own handler, which it chains to on a second signal

    def _start_generating(self) -> None:
        """Rank 0 builds the rollout side and starts the engines; every rank learns their URLs (or the
        error), the trainer ranks connect the weight bridge, and rollout starts once the engines hold
        the trainer's weights."""
        urls: Any = []
        if self.rank == 0:
            try:
                side = assembly.build_rollout(self.cfg, tokenizer=self.tokenizer, staleness=self.staleness,
                                              run_dir=self.run_dir, dump_groups=self.mode.dumps_groups,
                                              tracker=self.tracker, on_evict=self._on_evict)
                self.buffer, self.runtime, self.evaluation = side.buffer, side.runtime, side.evaluation
                self.recorder.skipped_at_load = side.skipped_at_load
                urls = side.urls
            except Exception as e:  # every rank must learn it, or the others hang in the broadcast
                urls = e if assembly.picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
        urls = self._broadcast(urls)
        if isinstance(urls, BaseException):
            raise urls
        if self.mode.syncs_weights:
            self.bridge = assembly.build_bridge(self.cfg, self.policy, urls, run_dir=self.run_dir)
            if self.version > 0 or assembly.first_sync_needed(self.cfg):  # engines start from model.hf_path
                self.bridge.sync(self.version)
                if self.rank == 0:
                    self.runtime.synced_version = self.version
        if self.rank == 0:  # engines hold the trainer's weights: rollout may start
            restore = self._resume
            if restore is not None:
                self.buffer.restore(restore["buffer"])
            self.runtime.start_rollout(restore=restore)
            # rollout.runner=process: from here on, stubs of the rollout process's own buffer and counters
            self.buffer, self.staleness = self.runtime.buffer, self.runtime.staleness

    def _maybe_resume(self) -> None:
        found = self.checkpoints.resume()
        if found is None:
            return
        meta, self._resume = found
        self.start_step, self.version = meta["step"] + 1, meta["version"]
        self.staleness.restore(version=self.version, consumed=self.version * self.batch_size)

    def maybe_evaluate(self, steps_done: int, *, final: bool = False) -> None:
        """Rank 0: the held-out evaluation when due (rollout/evaluation.py). It runs between two
        pushes — this thread alone pushes, and waits — so every request is served at one version."""
        if self.rank == 0 and self.evaluation is not None:
            self.evaluation.maybe(steps_done, version=self.version, first=steps_done == self.start_step, final=final)

    def _rollout_state(self) -> Any:
        return self.runtime.snapshot()

    def _on_evict(self, group: Group) -> None:
        if self.cfg.async_rl.stale_policy == "regenerate" and self.runtime is not None:
            self.runtime.requeue(group)

    def shutdown(self, error: Optional[BaseException]) -> None:
        if self.runtime is not None:
            self.runtime.stop()
        if self.checkpoints is not None and not self.preempted:
            # RolloutStopped reaches every rank, so the collective export after it is safe. After a
            # failed push the weights are the next version's.
            self.checkpoints.save_at_end(error, weights_version=self.version + self._trained,
                                         every_rank_stopped=isinstance(error, RolloutStopped))
        if self.bridge is not None:
            self.bridge.close()
        if self.tracker is not None:
            self.tracker.close()

    # ================================================================== stages
    def next_batch(self) -> list[Group]:
        """Rank 0 takes B trainable samples (whole groups) from the buffer; every rank gets them."""
        payload: Any = None
        if self.rank == 0:
            try:
                if self.mode.replays:
                    payload = self._replay_batch()
                else:
                    payload = self.buffer.take_batch(self.batch_size, timeout_s=self.cfg.async_rl.batch_timeout_s,
                                                     wake=self.handoff.wake())
            except (BufferClosed, TimeoutError) as e:
                cause = e.__cause__ if isinstance(e, BufferClosed) and e.__cause__ is not None else e
                where = f"; {where_samples_went(self.staleness, self.cfg.rollout)}" if isinstance(e, TimeoutError) else ""
                payload = RolloutStopped(f"no training batch at policy version {self.version}: {cause}{where}")
        payload = self._broadcast(payload)
        if payload is None:  # the run's only engine came back while this waited: it gets version V first
            self.handoff.rejoin(self.version)
            return self.next_batch()
        if isinstance(payload, BaseException):
            raise payload
        return payload

    def _replay_batch(self) -> list[Group]:
        groups, total = [], 0
        while total < self.batch_size:
            if not self.replay:
                raise BufferClosed(f"trainer.replay_path ran out of groups after step {self.version}")
            g = self.replay.pop(0)
            g.version_start = self.version  # replayed data is treated as on-policy for this step
            groups.append(g)
            total += len(g)
        return groups

    def make_batch(self, groups: list[Group]) -> TrainBatch:
        from megatron_flash.losses import compute_advantages, distill_advantages

        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
        adv = compute_advantages(self.cfg.loss.advantage, rewards=rewards, group_ids=group_ids,
                                 std_normalize=self.cfg.loss.advantage_std_normalize)
        batch = collate(samples, pad_id=self.pad_id, advantages=adv,
                        pad_to_multiple=self.cfg.parallel.tensor_model_parallel_size)
        if not self.mode.trains:
            return batch
        batch, self._overlong = recipes.overlong_filter(samples, batch, enabled=self.cfg.rollout.overlong_filter)
        d = self.cfg.distill
        if d.enabled:  # the teacher's per-token reverse KL in the advantage (after the filter: masked tokens stay 0)
            if d.topk:  # the top-K reverse KL, a loss term from the training forward (losses/distill.py)
                ids, lps = recipes.teacher_topk(samples, batch.loss_mask)
                batch = batch.replace(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
            elif d.student_logprobs == "current":  # the loss forms Â_t from its own forward (losses/distill.py)
                batch = batch.replace(teacher_logprobs=recipes.teacher_logprobs(samples, batch.loss_mask))
            else:
                batch = batch.replace(advantages=distill_advantages(
                    advantages=batch.advantages, student_logprobs=batch.behavior_logprobs,
                    teacher_logprobs=recipes.teacher_logprobs(samples, batch.loss_mask), loss_mask=batch.loss_mask,
                    coef=d.coef, mode=d.mode))
        batch = batch.replace(staleness=torch.tensor([staleness(self.version, s.version_start) for s in samples]))
        if self.version_check is not None:  # before training: the weights are still version V's
            self._check_metrics = self.version_check.step(self.version, samples, batch)
        if self.loss.needs_proximal and self.loss_fn.approximate_prox:  # π_prox from the training forward
            batch = batch.replace(behavior_lag=recipes.behavior_lags(samples, self.version, batch.loss_mask))
        elif self.loss.needs_proximal:  # π_prox = the weights this step starts from (version V)
            with TRACER.span("π_prox forward", "forward", TRAINER):
                batch = batch.replace(proximal_logprobs=self.policy.compute_logprobs(batch)[0] * batch.loss_mask)
        if getattr(self.loss, "needs_reference", False):  # KL(π_θ‖π_ref) against the start checkpoint
            with TRACER.span("reference forward", "forward", TRAINER):
                batch = batch.replace(
                    reference_logprobs=self.policy.compute_logprobs(batch, reference=True)[0] * batch.loss_mask)
        return batch

    def train(self, batch: TrainBatch) -> dict[str, float]:
        if not self.mode.trains:
            return {}
        t, n = self.cfg.trainer, self.cfg.rollout.n_samples_per_prompt
        size = t.global_batch_size
        fields = batch.replace(staleness=None)  # for metrics only
        rng = random.Random(t.seed * 1_000_003 + self.version)
        sums: dict[str, Optional[float]] = {}
        count = 0
        steps = t.num_epochs * (self.batch_size // size)  # optimizer steps this batch takes
        for _epoch in range(t.num_epochs):
            # Mini-batches hold whole groups; their order is reshuffled each epoch (seeded).
            groups = list(range(self.batch_size // n))
            if t.num_mini_batches > 1:
                rng.shuffle(groups)
            order = torch.tensor([g * n + i for g in groups for i in range(n)])
            for lo in range(0, self.batch_size, size):
                idx = order[lo:lo + size]
                self.loss_fn.theta_advance = count / steps  # how far π_θ has moved from π_prox
                with TRACER.span("optimizer step", "train", TRAINER, epoch=_epoch, mini_batch=lo // size):
                    metrics = self.policy.train_step(fields.rows(idx), self.loss_fn)
                self._note_nonfinite(metrics, fields.rows(idx))
                self._stop_on_blown_up_weights(metrics)
                for k, v in metrics.items():  # a null (e.g. mfu without a known peak) stays null
                    sums[k] = None if v is None or sums.get(k, 0.0) is None else sums.get(k, 0.0) + v
                count += 1
        return {f"train/{k}": None if v is None else v / count for k, v in sums.items()}

    def _note_nonfinite(self, metrics: dict[str, float], batch: TrainBatch) -> None:
        """Skipped optimizer steps (a NaN/inf gradient) in a row; at trainer.max_nonfinite_steps the run
        stops (every rank sees the same metrics, so all stop) with that batch dumped for inspection."""
        if not metrics.get("nonfinite_skipped"):
            self._nonfinite_run = 0
            return
        self._nonfinite_run += 1
        logger.warning("step at version %d: non-finite gradient, optimizer step skipped (%d in a row)",
                       self.version, self._nonfinite_run)
        if self._nonfinite_run < self.cfg.trainer.max_nonfinite_steps:
            return
        path = os.path.join(self.run_dir, f"nonfinite_batch_v{self.version}.jsonl")
        if self.rank == 0:
            with open(path, "w") as f:
                for i in range(batch.tokens.shape[0]):
                    row = {k: getattr(batch, k)[i].tolist() for k in (
                        "tokens", "loss_mask", "behavior_logprobs", "advantages", "proximal_logprobs",
                        "teacher_logprobs", "rewards")
                           if getattr(batch, k, None) is not None}
                    f.write(json.dumps(row) + "\n")
        raise RuntimeError(f"{self._nonfinite_run} optimizer steps in a row had a non-finite gradient "
                           f"(trainer.max_nonfinite_steps={self.cfg.trainer.max_nonfinite_steps}) at policy version "
                           f"{self.version}; the last batch's samples are in {path}")

    def _stop_on_blown_up_weights(self, metrics: dict[str, float]) -> None:
        """An update with finite gradients that left non-finite (or overflowing) weights: every rank reads
        the same all-reduced flag (trainer/weight_health.py), so all stop here, before the push."""
        if not metrics.get("weights_nonfinite"):
            return
        self._trained = True  # the weights are the next version's: what is exported at the stop says so
        raise RuntimeError(
            f"the optimizer step at policy version {self.version} left non-finite weights (NaN/inf, or a tensor "
            f"norm above ~1e19) though its gradients were finite; stopped before pushing them: the engines "
            f"still serve version {self.version}. Last good checkpoint: {self.checkpoints.last_good()}")

    def push_weights(self) -> dict[str, float]:
        """Send the new weights to every engine; V ← V + 1 (frees rollout capacity)."""
        t0 = time.monotonic()
        with TRACER.span("weight push", "sync", TRAINER, version=self.version + 1):
            out = self.handoff.push(self.version + 1)
        self.version += 1
        if self.rank == 0:
            self.staleness.set_version(self.version)
        out["time_sync"] = time.monotonic() - t0
        out.update(self.handoff.release_metrics())
        return out

    def log(self, step: int, groups: list[Group], batch: TrainBatch, train_metrics: dict[str, float],
            sync_metrics: dict[str, float], *, t_start: float, t_wait: float, t_train: float,
            t_step: float) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        checks, self._check_metrics = self._check_metrics, {}
        start, wait, train = (round(t * 1e9) for t in (t_start, t_wait, t_train))  # time.monotonic's clock, in ns
        TRACER.complete("batch wait", "wait", TRAINER, start_ns=start, end_ns=start + wait)
        TRACER.complete("train", "train", TRAINER, start_ns=start + wait, end_ns=start + wait + train)
        TRACER.complete(f"step {step}", "step", TRAINER, start_ns=start, end_ns=start + round(t_step * 1e9),
                        version=self.version)
        return self.recorder.record(step, version=self.version, groups=groups, batch=batch, staleness=self.staleness,
                                    runtime=self.runtime, overlong=self._overlong, checks=checks,
                                    sync_metrics=sync_metrics, train_metrics=train_metrics,
                                    t_wait=t_wait, t_train=t_train, t_step=t_step,
                                    train_window_ns=(start + wait, start + wait + train))

    # ================================================================== plumbing
    def _broadcast(self, obj: Any) -> Any:
        if self._ctrl_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctrl_group)
        return box[0]


def run(cfg: Any, *, loss: Any = None) -> dict[str, Any]:
    """Entry used by launch/pretrain_async_rl.py (which builds and checks the loss first)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    return Controller(cfg, loss=loss).run()
