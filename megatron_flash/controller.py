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
(L + 1)·B + extra samples in flight or buffered beyond what was consumed, the lookahead L ≤ α
raised only while the trainer waits for rollout); the trainer waits only
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
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron_flash import recipes
from megatron_flash.buffer.sample_buffer import BufferClosed, SampleBuffer
from megatron_flash.buffer.staleness import StalenessManager, staleness
from megatron_flash.config.schema import RUN_MODES
from megatron_flash.types import Group, TrainBatch, collate

if TYPE_CHECKING:
    from megatron_flash.config.schema import RunConfig
    from megatron_flash.losses import Loss
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.tracking import Tracker
    from megatron_flash.trainer.policy import MegatronPolicy
    from megatron_flash.weight_sync.bridge import WeightBridge

logger = logging.getLogger(__name__)


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
        self._totals: dict[str, float] = {}
        self._release_metrics: dict[str, float] = {}
        self.evaluation: Any = None  # rank 0, with eval.datasets: rollout.evaluation.PeriodicEvaluation
        self._overlong: dict[str, int] = {}  # this step's overlong-filter counts (recipes.overlong_filter)
        self._skipped_at_load = 0  # prompts that could never fit the engines' context
        self._nonfinite_run = 0  # optimizer steps skipped in a row for a non-finite gradient
        self._trained = False  # the policy's weights are one update ahead of self.version (push pending)
        self.version_check: Any = None  # trainer/version_check.VersionCheck, when trainer.version_check_interval
        self._check_metrics: dict[str, float] = {}

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
                self.release_engines()                                    # colocated: engines sleep
                batch = self.make_batch(groups)                           # advantages, π_prox
                train_metrics = self.train(batch)                         # epochs × mini-batches
                self._trained = True
                t_train = time.monotonic() - t0 - t_wait
                sync_metrics = self.push_weights()                        # pause → send → resume; V += 1
                self._trained = False
                self.maybe_evaluate(step + 1)                             # held-out sets, at version V
                summary = self.log(step, groups, batch, train_metrics, sync_metrics,
                                   t_wait=t_wait, t_train=t_train, t_step=time.monotonic() - t0)
                if self.maybe_checkpoint(step):                           # every N steps; SIGTERM: save, stop
                    self.preempted = True
                    break
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
        self.loss, self.loss_fn = _loss_fns(cfg.loss, self._loss, cfg.rollout.max_new_tokens)
        self.staleness = StalenessManager(alpha=cfg.async_rl.alpha, batch_size=self.batch_size,
                                          extra=cfg.rollout.extra_prompts * cfg.rollout.n_samples_per_prompt,
                                          admission=cfg.async_rl.admission)
        if self.mode.trains:
            self.policy = _build_policy(cfg)
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
            self._maybe_resume()
        if self.rank == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                f.write(config_to_yaml(cfg))
        self.tokenizer = _tokenizer(cfg.model.hf_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        from megatron_flash.tracking import Tracker

        self.tracker = Tracker(self.run_dir, cfg.logging, total_steps=cfg.trainer.total_steps,
                               config=_as_dict(cfg), rank=self.rank)
        if self.mode.replays:
            from megatron_flash.rollout.runtime import read_group_dump

            self.replay = read_group_dump(cfg.trainer.replay_path)
        if not self.mode.generates:
            return
        urls: Any = []
        if self.rank == 0:
            try:
                urls = self._start_rollout()
            except Exception as e:  # every rank must learn it, or the others hang in the broadcast
                urls = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
        urls = self._broadcast(urls)
        if isinstance(urls, BaseException):
            raise urls
        if self.mode.syncs_weights:
            from megatron_flash.weight_sync.bridge import WeightBridge, default_disk_dir

            self.bridge = WeightBridge.from_config(
                self.policy, urls, cfg.weight_sync, pause_mode=cfg.rollout.pause_mode, api_key=cfg.engines.api_key,
                disk_dir=default_disk_dir(self.run_dir), engine_tp_size=cfg.engines.tp_size,
                master_address=_sender_address(urls), colocate=cfg.engines.colocate)
            if self.version > 0:  # resumed: engines start from model.hf_path, the trainer is at V
                self.bridge.sync(self.version)
        if self.rank == 0:  # engines hold the trainer's weights: rollout may start
            restore = self._resume
            if restore is not None:
                self.buffer.restore(restore["buffer"])
            self.runtime.start_rollout(restore=restore)
            # rollout.runner=process: from here on, stubs of the rollout process's own buffer and counters
            self.buffer, self.staleness = self.runtime.buffer, self.runtime.staleness
        self.maybe_evaluate(self.start_step)  # before training (or where a resumed run starts)
        _install_sigterm_flag()  # after the launcher's own handler, which it chains to on a second signal

    # ================================================================== checkpoints
    def _maybe_resume(self) -> None:
        from megatron_flash.trainer import checkpoint as ckpt

        c = self.cfg.checkpoint
        path = ckpt.latest_checkpoint(c.save_dir) if c.resume else None
        if path is None:
            if self.rank == 0 and c.resume:
                logger.info("checkpoint.resume: no checkpoint under %s yet; starting fresh", c.save_dir)
            return
        meta, rollout = ckpt.load(self.policy, path)
        self.start_step, self.version = meta["step"] + 1, meta["version"]
        self.staleness.restore(version=self.version, consumed=self.version * self.batch_size)
        self._resume = rollout
        if self.rank == 0:
            _truncate_ledger(os.path.join(self.run_dir, LEDGER), keep_through=meta["step"])
            logger.info("resumed from %s: step %d done, policy version %d", path, meta["step"], self.version)

    def maybe_checkpoint(self, step: int) -> bool:
        """Save every checkpoint.save_interval steps, and when SIGTERM arrived on any rank (then
        returns True: the run stops after saving). Collective over the trainer ranks."""
        c = self.cfg.checkpoint
        stop = _SIGTERM["seen"]
        if self._ctrl_group is not None:
            flag = torch.tensor([1 if stop else 0])
            dist.all_reduce(flag, group=self._ctrl_group)
            stop = bool(flag.item())
        if c.save_hf_interval > 0 and (step + 1) % c.save_hf_interval == 0 and self.mode.trains:
            # Before the Megatron checkpoint: a run killed during the export resumes from the step
            # before and exports this step again (a half-written export never has a checkpoint after it).
            self.export_hf_checkpoint(step)
        due = c.save_interval > 0 and (step + 1) % c.save_interval == 0
        if (due or stop) and c.save_dir and self.mode.checkpoints:
            from megatron_flash.trainer import checkpoint as ckpt

            t0 = time.monotonic()
            rollout = self.runtime.snapshot() if self.rank == 0 else None
            path = ckpt.save(self.policy, c.save_dir, step=step, version=self.version, rollout_state=rollout,
                             group=self._ctrl_group)
            if self.rank == 0:
                logger.info("checkpoint %s (%.2f s)%s", path, time.monotonic() - t0,
                            "; stopping on SIGTERM" if stop else "")
        return stop

    def maybe_evaluate(self, steps_done: int, *, final: bool = False) -> None:
        """Rank 0: the held-out evaluation when due (rollout/evaluation.py). It runs between two
        pushes — this thread alone pushes, and waits — so every request is served at one version."""
        if self.rank == 0 and self.evaluation is not None:
            self.evaluation.maybe(steps_done, version=self.version, first=steps_done == self.start_step, final=final)

    def hf_dir(self) -> str:
        return os.path.join(self.cfg.checkpoint.save_dir or self.run_dir, "hf")

    def export_hf_checkpoint(self, step: int) -> str:
        """HF checkpoint of the weights after `step` (collective), then hf/latest → it (rank 0)."""
        from megatron_flash.hf.io import point_latest

        t0 = time.monotonic()
        name = f"step_{step + 1:06d}"
        out = os.path.join(self.hf_dir(), name)
        self.policy.export_hf(out)
        if self.rank == 0:
            point_latest(self.hf_dir(), name)
            logger.info("HF checkpoint %s (%.2f s)", out, time.monotonic() - t0)
        return out

    def _start_rollout(self) -> list[str]:
        """Rank 0: dataset, buffer, engines (healthy); the rollout thread starts later."""
        from megatron_flash.rollout.dataset import PromptDataset
        from megatron_flash.rollout.runtime import RolloutRuntime

        cfg = self.cfg
        runner_factory: Any = None
        if cfg.agentic.env:  # groups are episodes of one env seed each
            from megatron_flash.agentic.env_manager import EnvGroupRunner, SeedDataset
            from megatron_flash.rollout.runtime import sampling_params

            dataset: Any = SeedDataset(first_seed=cfg.agentic.seed, num_seeds=cfg.agentic.num_seeds)

            def episodes(proxy: Any, version_fn: Any) -> Any:
                return EnvGroupRunner(agentic_cfg=cfg.agentic, proxy=proxy, tokenizer=self.tokenizer,
                                      sampling_params=sampling_params(cfg.rollout), max_seq_len=cfg.trainer.max_seq_len,
                                      version_fn=version_fn, max_resumes=cfg.rollout.max_resumes)

            runner_factory = episodes
        elif cfg.agentic.workflow:  # groups are episodes of an OpenAI-API agent on one data item each
            from megatron_flash.agentic.workflow import WorkflowGroupRunner
            from megatron_flash.rollout.runtime import sampling_params

            dataset = PromptDataset.from_config(cfg.data, self.tokenizer, seed=cfg.trainer.seed)

            def agent_episodes(proxy: Any, version_fn: Any) -> Any:
                return WorkflowGroupRunner(agentic_cfg=cfg.agentic, proxy=proxy, tokenizer=self.tokenizer,
                                           model_name="policy", sampling_params=sampling_params(cfg.rollout),
                                           max_seq_len=cfg.trainer.max_seq_len, version_fn=version_fn)

            runner_factory = agent_episodes
        else:
            dataset = PromptDataset.from_config(cfg.data, self.tokenizer, seed=cfg.trainer.seed)
        self.buffer = SampleBuffer(self.staleness, stale_policy=cfg.async_rl.stale_policy, on_evict=self._on_evict)
        self.runtime = RolloutRuntime(cfg.engines, cfg.rollout, run_dir=self.run_dir, staleness=self.staleness,
                                      buffer=self.buffer, dataset=dataset, model_path=cfg.model.hf_path,
                                      tokenizer=self.tokenizer, dump_groups=self.mode.dumps_groups,
                                      group_runner_factory=runner_factory,
                                      return_routed_experts=cfg.trainer.moe_routing_replay == "rollout")
        if cfg.eval.datasets:  # loaded (and checked) before any engine starts
            from megatron_flash.rollout.evaluation import PeriodicEvaluation, load_eval_sets

            self.evaluation = PeriodicEvaluation(
                cfg.eval, load_eval_sets(cfg.eval, self.tokenizer, seed=cfg.trainer.seed), run_dir=self.run_dir,
                max_new_tokens=cfg.rollout.max_new_tokens, runtime=self.runtime, tracker=self.tracker)
        urls = self.runtime.start_engines()
        logger.info("engines up: %s", urls)
        if not (cfg.agentic.env or cfg.agentic.workflow):  # prompts that can never fit: dropped now, counted
            self._skipped_at_load = self.runtime.fit_prompts_to_engines(cfg.rollout.max_new_tokens)
        return urls

    def _on_evict(self, group: Group) -> None:
        if self.cfg.async_rl.stale_policy == "regenerate" and self.runtime is not None:
            self.runtime.requeue(group)

    def shutdown(self, error: Optional[BaseException]) -> None:
        if self.runtime is not None:
            self.runtime.stop()
        if self.policy is None or self.preempted:
            pass
        elif error is None and self.cfg.checkpoint.save_hf_at_end:
            out = os.path.join(self.cfg.checkpoint.save_dir or self.run_dir, "final_hf")
            self.policy.export_hf(out)
            if self.rank == 0:
                logger.info("final HF checkpoint: %s", out)
        elif isinstance(error, RolloutStopped) or (isinstance(error, Exception) and self.policy.layout.world_size == 1):
            # RolloutStopped reaches every rank (so the collective export is safe); a single rank can
            # always save. Save what training reached.
            weights = self.version + self._trained  # a push that failed: the weights are the next version's
            out = os.path.join(self.run_dir, f"hf_at_stop_v{weights}")
            try:
                self.policy.export_hf(out)
            except Exception as e:  # e.g. the disk that failed the checkpoint: the first error is the one to report
                shutil.rmtree(out + ".partial", ignore_errors=True)
                logger.error("%s; policy version %d could not be saved to %s either: %s", error, weights, out, e)
            else:
                if self.rank == 0:
                    logger.error("%s; policy version %d saved to %s", error, weights, out)
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
                    payload = self.buffer.take_batch(self.batch_size, timeout_s=self.cfg.async_rl.batch_timeout_s)
            except (BufferClosed, TimeoutError) as e:
                cause = e.__cause__ if isinstance(e, BufferClosed) and e.__cause__ is not None else e
                payload = RolloutStopped(f"no training batch at policy version {self.version}: {cause}"
                                         + (f"; {self._where_samples_went()}" if isinstance(e, TimeoutError) else ""))
        payload = self._broadcast(payload)
        if isinstance(payload, BaseException):
            raise payload
        return payload

    def _where_samples_went(self) -> str:
        """Why a batch never filled: every sample admitted so far, by what became of it."""
        c, r = self.staleness.snapshot(), self.cfg.rollout
        return (f"of {c.submitted} samples admitted, {c.consumed} trained, {c.outstanding} in flight or buffered, "
                f"{c.dropped_filtered} dropped by rollout.dynamic_filter={r.dynamic_filter}, {c.dropped_failed} by "
                f"failed rewards, {c.dropped_stale + c.regenerated_stale} stale, {c.dropped_error} by engine errors, "
                f"{c.skipped} skipped (refused or failing prompts)")

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
        from megatron_flash.losses import compute_advantages

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
        batch = batch.replace(staleness=torch.tensor([staleness(self.version, s.version_start) for s in samples]))
        if self.version_check is not None:  # before training: the weights are still version V's
            self._check_metrics = self.version_check.step(self.version, samples, batch)
        if self.loss.needs_proximal:  # π_prox = the weights this step starts from (version V)
            batch = batch.replace(proximal_logprobs=self.policy.compute_logprobs(batch)[0] * batch.loss_mask)
        if getattr(self.loss, "needs_reference", False):  # KL(π_θ‖π_ref) against the start checkpoint
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
        sums: dict[str, float] = {}
        count = 0
        for _epoch in range(t.num_epochs):
            # Mini-batches hold whole groups; their order is reshuffled each epoch (seeded).
            groups = list(range(self.batch_size // n))
            if t.num_mini_batches > 1:
                rng.shuffle(groups)
            order = torch.tensor([g * n + i for g in groups for i in range(n)])
            for lo in range(0, self.batch_size, size):
                idx = order[lo:lo + size]
                metrics = self.policy.train_step(fields.rows(idx), self.loss_fn)
                self._note_nonfinite(metrics, fields.rows(idx))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {f"train/{k}": v / count for k, v in sums.items()}

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
                    row = {k: getattr(batch, k)[i].tolist() for k in ("tokens", "loss_mask", "behavior_logprobs",
                                                                       "advantages", "proximal_logprobs", "rewards")
                           if getattr(batch, k, None) is not None}
                    f.write(json.dumps(row) + "\n")
        raise RuntimeError(f"{self._nonfinite_run} optimizer steps in a row had a non-finite gradient "
                           f"(trainer.max_nonfinite_steps={self.cfg.trainer.max_nonfinite_steps}) at policy version "
                           f"{self.version}; the last batch's samples are in {path}")

    def release_engines(self) -> None:
        """engines.colocate: the engines give their memory back before the trainer computes (they take
        it back inside the next push: weights, then the new values, then the KV cache)."""
        self._release_metrics = {}
        if self.bridge is None or self.bridge.memory is None:
            return
        t0 = time.monotonic()
        errors = self.bridge.release_memory()
        if errors and self.rank == 0 and self.runtime is not None:
            self.runtime.note_sync(self.version, errors)
        self._release_metrics = {"time_release": time.monotonic() - t0}

    def push_weights(self) -> dict[str, float]:
        """Send the new weights to every engine; V ← V + 1 (frees rollout capacity)."""
        out: dict[str, float] = {}
        t0 = time.monotonic()
        if self.bridge is not None:
            restarted: Any = ([], [])
            if self.rank == 0 and self.runtime is not None:
                restarted = self.runtime.take_restarted()
            rejoin, restart_s = self._broadcast(restarted)
            if rejoin:  # restarted engines hold the checkpoint's weights: this sync sends them everything
                self.bridge.readmit(rejoin)
                out["engines_restarted"] = len(rejoin)
                out["engine_restart_s"] = max(restart_s) if restart_s else float("nan")
            report = self.bridge.sync(self.version + 1)
            out["sync_gb"] = report.bytes_sent / 1e9
            out["engines_out_of_service"] = len(self.bridge.failed)
            out["engines_resynced"] = len(report.resynced_urls)
            if report.mean_abs_logprob_diff is not None:  # the post-sync probe, engine vs trainer
                out["train_infer_logprob_diff"] = float(report.mean_abs_logprob_diff)
                out["train_infer_logprob_diff_max"] = float(report.max_abs_logprob_diff)
                out["time_probe"] = report.probe_seconds
            if self.rank == 0 and self.runtime is not None:
                self.runtime.note_sync(self.version + 1, {u: report.errors.get(u, "failed") for u in report.failed_urls})
        self.version += 1
        if self.rank == 0:
            self.staleness.set_version(self.version)
        out["time_sync"] = time.monotonic() - t0
        out.update(self._release_metrics)
        return out

    # ================================================================== tracking
    def log(self, step: int, groups: list[Group], batch: TrainBatch, train_metrics: dict[str, float],
            sync_metrics: dict[str, float], *, t_wait: float, t_train: float, t_step: float) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        samples = [s for g in groups for s in g.samples]
        lags = [self.version - 1 - s.version_start for s in samples]
        c = self.staleness.snapshot()
        m: dict[str, Any] = {
            "version": self.version,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) if s.response_mask is None else sum(s.response_mask)
                                     for s in samples) / len(samples),  # model tokens only
            "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
            "dropped_stale": c.dropped_stale, "regenerated_stale": c.regenerated_stale,
            "dropped_filtered": c.dropped_filtered, "reward_failed": c.dropped_failed,
            # Cumulative sample accounting: admitted = trained + outstanding + every drop and skip.
            "samples_admitted": c.submitted, "samples_trained": c.consumed, "samples_outstanding": c.outstanding,
            "samples_skipped": c.skipped, "dropped_error": c.dropped_error, "samples_cancelled": c.cancelled,
            "time_rollout_wait": t_wait, "time_train": t_train, "time_step": t_step,
            "samples_per_s": len(samples) / max(t_step, 1e-9),
            "overlong_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            **self._overlong,
        }
        mismatch, histograms = recipes.mismatch_metrics(batch)
        if "train_infer_logprob_diff" in sync_metrics:  # the probe's, when it ran, is the one logged
            mismatch.pop("train_infer_logprob_diff", None)
        m.update(mismatch)
        if self.runtime is not None:
            stats, engine = self.runtime.take_metrics()
            m.update(engine)
            m["tokens_per_s"] = stats.tokens_generated / max(t_step, 1e-9)
            m["rollout_resumes"] = stats.resumes
            m["engine_errors"] = stats.engine_errors
            m["skipped_prompts"] = stats.skipped_prompts  # refused (4xx) or failing past max_prompt_retries
            m["skipped_after_retries"] = stats.skipped_after_retries
            m["skipped_prompts_at_load"] = self._skipped_at_load  # could never fit the engines
            m["groups_expired_in_flight"] = stats.groups_expired  # redundant surplus cancelled at a push
            if self.cfg.rollout.overlong_buffer_len:
                m["overlong_penalized"] = stats.overlong_penalized
                m["overlong_penalty_mean"] = stats.overlong_penalty_sum / max(stats.overlong_penalized, 1)
        m.update(recipes.length_bias(samples, self.staleness.take_drop_lengths()))
        m.update(recipes.token_staleness(samples, self.version - 1))
        m["rollout_lookahead"] = c.lookahead
        m.update(self._check_metrics)
        self._check_metrics = {}
        m.update(sync_metrics)
        m.setdefault("train_infer_logprob_diff", None)  # neither a probe nor fresh samples this step
        m.setdefault("mismatch_k3", None)  # no fresh sample, or a loss without π_prox
        m.setdefault("mismatch_log_ppl_gap", None)
        m.update(train_metrics)
        self.tracker.log(step, m)
        histograms["length/trained"] = [len(s.response_ids) for s in samples]
        self.tracker.log_histograms(step, histograms)
        with open(os.path.join(self.run_dir, LEDGER), "a") as f:  # which prompts each step trained
            f.write(json.dumps({"step": step, "version": self.version,
                                "prompt_indices": sorted(g.prompt_index for g in groups)}) + "\n")
        return m

    # ================================================================== plumbing
    def _broadcast(self, obj: Any) -> Any:
        if self._ctrl_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctrl_group)
        return box[0]


LEDGER = "trained_prompts.jsonl"
_SIGTERM: dict[str, Any] = {"seen": False, "at": 0.0}


def _install_sigterm_flag() -> None:
    """SIGTERM (Slurm pre-emption, torchrun stopping) → save at the end of this step and stop."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if _SIGTERM["seen"] and now - _SIGTERM["at"] < 10.0:
            # scancel signals every process of the job and torchrun forwards its own copy: one event.
            return
        if _SIGTERM["seen"] and callable(previous):  # a later SIGTERM: stop now (engines too)
            previous(signum, frame)
            return
        if _SIGTERM["seen"]:
            raise SystemExit(128 + signum)
        _SIGTERM["seen"], _SIGTERM["at"] = True, now
        logger.warning("SIGTERM: checkpointing at the end of this step, then stopping (again after 10 s "
                       "to stop now)")

    signal.signal(signal.SIGTERM, handler)


def _truncate_ledger(path: str, *, keep_through: int) -> None:
    """Drop ledger lines of steps after the checkpoint (they will be trained again)."""
    import json

    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_through]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _sender_address(urls: list[str]) -> str:
    """Where engines reach this rank's weight-update group: loopback when every engine is local,
    else this node's address (MF_WEIGHT_SYNC_ADDR overrides, e.g. an InfiniBand interface's IP)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("MF_WEIGHT_SYNC_ADDR"):
        return os.environ["MF_WEIGHT_SYNC_ADDR"]
    hosts = {urlparse(u).hostname for u in urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    return socket.gethostbyname(socket.getfqdn())


def _picklable(obj: Any) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:
        return False


def _loss_fns(loss_cfg: Any, loss: Any, max_new_tokens: int) -> tuple[Any, Any]:
    """(Loss, the trainer's loss_fn): the launcher's already-checked loss when it passed one."""
    from megatron_flash.trainer.loss_adapter import aggregation_norm, build_loss, make_loss_fn

    loss = loss if loss is not None else build_loss(loss_cfg)
    return loss, make_loss_fn(loss, aggregation=loss_cfg.aggregation,
                              norm=aggregation_norm(loss_cfg, max_new_tokens))


def _build_policy(cfg: Any) -> Any:
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings

    return MegatronPolicy(PolicySettings.from_sections(model=cfg.model, parallel=cfg.parallel, trainer=cfg.trainer,
                                                       optimizer=cfg.optimizer))


def _tokenizer(path: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def _as_dict(cfg: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def run(cfg: Any, *, loss: Any = None) -> dict[str, Any]:
    """Entry used by launch/pretrain_async_rl.py (which builds and checks the loss first)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    return Controller(cfg, loss=loss).run()
