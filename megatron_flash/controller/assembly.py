"""Building a run's components from its config, for the controller: the loss and the trainer's loss
function, the Megatron policy, the tokenizer, and on rank 0 the rollout side (dataset or env seeds,
the group runner for agentic runs, the sample buffer, the rollout runtime with its engines, the
periodic evaluation). Nothing here runs a step; the loop in loop.py owns the order of things.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_flash.buffer.sample_buffer import SampleBuffer
from megatron_flash.types import Group

if TYPE_CHECKING:
    from megatron_flash.buffer.staleness import StalenessManager
    from megatron_flash.config.schema import RunConfig
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.tracking import Tracker

logger = logging.getLogger(__name__)


@dataclass
class RolloutSide:
    """Rank 0's rollout components, engines healthy; the rollout thread starts later."""
    buffer: SampleBuffer
    runtime: "RolloutRuntime"
    evaluation: Any  # rollout.evaluation.PeriodicEvaluation, with eval.datasets
    urls: list[str]
    skipped_at_load: int  # prompts that can never fit the engines' context: dropped now, counted


def build_rollout(cfg: "RunConfig", *, tokenizer: Any, staleness: "StalenessManager", run_dir: str,
                  dump_groups: bool, tracker: Optional["Tracker"], on_evict: Callable[[Group], None]) -> RolloutSide:
    from megatron_flash.rollout.dataset import PromptDataset
    from megatron_flash.rollout.runtime import RolloutRuntime

    runner_factory: Any = None
    if cfg.agentic.env:  # groups are episodes of one env seed each
        from megatron_flash.agentic.env_manager import EnvGroupRunner, SeedDataset
        from megatron_flash.rollout.runtime import sampling_params

        dataset: Any = SeedDataset(first_seed=cfg.agentic.seed, num_seeds=cfg.agentic.num_seeds)

        def episodes(proxy: Any, version_fn: Any) -> Any:
            return EnvGroupRunner(agentic_cfg=cfg.agentic, proxy=proxy, tokenizer=tokenizer,
                                  sampling_params=sampling_params(cfg.rollout), max_seq_len=cfg.trainer.max_seq_len,
                                  version_fn=version_fn, max_resumes=cfg.rollout.max_resumes)

        runner_factory = episodes
    elif cfg.agentic.workflow:  # groups are episodes of an OpenAI-API agent on one data item each
        from megatron_flash.agentic.workflow import WorkflowGroupRunner
        from megatron_flash.rollout.runtime import sampling_params

        dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed)

        def agent_episodes(proxy: Any, version_fn: Any) -> Any:
            return WorkflowGroupRunner(agentic_cfg=cfg.agentic, proxy=proxy, tokenizer=tokenizer,
                                       model_name="policy", sampling_params=sampling_params(cfg.rollout),
                                       max_seq_len=cfg.trainer.max_seq_len, version_fn=version_fn)

        runner_factory = agent_episodes
    else:
        dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed)
    if cfg.distill.enabled:  # before any engine starts: a teacher that cannot score these ids is refused
        from megatron_flash.rollout.teacher import check_same_tokenizer

        try:
            teacher_tokenizer = build_tokenizer(cfg.distill.teacher)
        except (OSError, ValueError) as e:
            raise ValueError(f"distill.teacher={cfg.distill.teacher!r}: cannot load the teacher's tokenizer "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        check_same_tokenizer(tokenizer, teacher_tokenizer, student_path=cfg.model.hf_path,
                             teacher_path=cfg.distill.teacher)
        if cfg.distill.topk > len(tokenizer):
            raise ValueError(f"distill.topk={cfg.distill.topk} is more than the vocabulary of distill.teacher="
                             f"{cfg.distill.teacher!r} ({len(tokenizer)} tokens)")
    buffer = SampleBuffer(staleness, stale_policy=cfg.async_rl.stale_policy, on_evict=on_evict)
    runtime = RolloutRuntime(cfg.engines, cfg.rollout, run_dir=run_dir, staleness=staleness,
                             buffer=buffer, dataset=dataset, model_path=cfg.model.hf_path,
                             tokenizer=tokenizer, dump_groups=dump_groups,
                             group_runner_factory=runner_factory,
                             return_routed_experts=cfg.trainer.moe_routing_replay == "rollout",
                             distill=cfg.distill, lora_adapters=lora_serving(cfg))
    evaluation = None
    if cfg.eval.datasets:  # loaded (and checked) before any engine starts
        from megatron_flash.rollout.evaluation import PeriodicEvaluation, load_eval_sets

        evaluation = PeriodicEvaluation(
            cfg.eval, load_eval_sets(cfg.eval, tokenizer, seed=cfg.trainer.seed), run_dir=run_dir,
            max_new_tokens=cfg.rollout.max_new_tokens, runtime=runtime, tracker=tracker)
    urls = runtime.start_engines()
    logger.info("engines up: %s", urls)
    skipped = 0
    if not (cfg.agentic.env or cfg.agentic.workflow):  # prompts that can never fit: dropped now, counted
        skipped = runtime.fit_prompts_to_engines(cfg.rollout.max_new_tokens)
    return RolloutSide(buffer=buffer, runtime=runtime, evaluation=evaluation, urls=urls, skipped_at_load=skipped)


def build_bridge(cfg: "RunConfig", policy: Any, urls: list[str], *, run_dir: str) -> Any:
    from megatron_flash.weight_sync.bridge import WeightBridge, default_disk_dir
    from megatron_flash.weight_sync.fault_injection import sync_cut_hook

    bridge = WeightBridge.from_config(
        policy, urls, cfg.weight_sync, pause_mode=cfg.rollout.pause_mode, api_key=cfg.engines.api_key,
        disk_dir=default_disk_dir(run_dir), engine_tp_size=cfg.engines.tp_size,
        master_address=sender_address(urls), colocate=cfg.engines.colocate, lora=cfg.lora_sync_mode(),
        delta=cfg.delta_sync(), engine_dtype=cfg.engines.dtype or None, probe_threshold=cfg.probe_threshold())
    bridge.executor.on_bucket = sync_cut_hook(bridge)  # None unless MF_FAULT_CUT_SYNC_FILE is set (benchmarks)
    return bridge


def lora_serving(cfg: "RunConfig") -> Optional[dict]:
    """What the engines must serve when LoRA adapters are pushed by name (weight_sync.lora=adapter):
    adapters up to model.lora.rank on the HF modules of model.lora.targets; None otherwise."""
    if cfg.lora_sync_mode() != "adapter":
        return None
    from megatron_flash.hf.adapters import HF_TARGET_MODULES

    return {"rank": cfg.model.lora.rank,
            "target_modules": sorted({m for t in cfg.model.lora.targets for m in HF_TARGET_MODULES[t]})}


def first_sync_needed(cfg: "RunConfig") -> bool:
    """Engines start from model.hf_path; a fresh run's version 0 is something else with a start adapter
    (model.lora.adapter_path), and adapters pushed by name are named from version 0 on (a request
    naming none would get the base)."""
    return bool(cfg.model.lora.adapter_path) or cfg.lora_sync_mode() == "adapter"


def sender_address(urls: list[str]) -> str:
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


def picklable(obj: Any) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:
        return False


def check_loss(cfg: "RunConfig", loss: Any) -> str:
    """Refuse a loss without behaviour correction on off-policy samples (unless loss.allow_uncorrected,
    which is refused where it lifts nothing); returns the line a run logs first: which policy each ratio
    is taken against, which correction applies, and why the samples are on- or off-policy."""
    from megatron_flash.losses.registry import corrected_losses

    reason = cfg.off_policy_reason()
    if loss.on_policy and reason and not cfg.loss.allow_uncorrected:
        raise ValueError(
            f"loss.name={loss.name} has no behaviour correction ({loss.description}), so it is right on-policy "
            f"only, but {reason}: use a loss that corrects for the behaviour policy μ (loss.name="
            f"{'|'.join(corrected_losses())}), or set loss.allow_uncorrected=true to train it uncorrected anyway")
    if cfg.loss.allow_uncorrected and not loss.on_policy:
        raise ValueError(f"loss.allow_uncorrected=true is only used with a loss that has no behaviour correction; "
                         f"loss.name={loss.name} has one ({loss.description})")
    data = f"off-policy data: {reason}" if reason else f"on-policy data (async_rl.alpha={cfg.async_rl.alpha})"
    opt_in = "; loss.allow_uncorrected=true: stale samples train uncorrected" if loss.on_policy and reason else ""
    return f"loss {loss.name}: {loss.description}; {data}{opt_in}"


def loss_fns(loss_cfg: Any, loss: Any, max_new_tokens: int, distill_cfg: Any = None) -> tuple[Any, Any]:
    """(Loss, the trainer's loss_fn): the launcher's already-checked loss when it passed one."""
    from megatron_flash.trainer.loss_adapter import aggregation_norm, build_loss, make_loss_fn

    loss = loss if loss is not None else build_loss(loss_cfg)
    in_loss = distill_cfg is not None and distill_cfg.enabled and distill_cfg.student_logprobs == "current"
    return loss, make_loss_fn(loss, aggregation=loss_cfg.aggregation, norm=aggregation_norm(loss_cfg, max_new_tokens),
                              approximate_prox=loss_cfg.prox_logprobs == "approximate",
                              distill=(distill_cfg.coef, distill_cfg.mode) if in_loss else None)


def build_policy(cfg: Any) -> Any:
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings

    return MegatronPolicy(PolicySettings.from_sections(model=cfg.model, parallel=cfg.parallel, trainer=cfg.trainer,
                                                       optimizer=cfg.optimizer))


def build_tokenizer(path: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def config_dict(cfg: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)
