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
    buffer = SampleBuffer(staleness, stale_policy=cfg.async_rl.stale_policy, on_evict=on_evict)
    runtime = RolloutRuntime(cfg.engines, cfg.rollout, run_dir=run_dir, staleness=staleness,
                             buffer=buffer, dataset=dataset, model_path=cfg.model.hf_path,
                             tokenizer=tokenizer, dump_groups=dump_groups,
                             group_runner_factory=runner_factory,
                             return_routed_experts=cfg.trainer.moe_routing_replay == "rollout")
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

    return WeightBridge.from_config(
        policy, urls, cfg.weight_sync, pause_mode=cfg.rollout.pause_mode, api_key=cfg.engines.api_key,
        disk_dir=default_disk_dir(run_dir), engine_tp_size=cfg.engines.tp_size,
        master_address=sender_address(urls), colocate=cfg.engines.colocate)


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


def loss_fns(loss_cfg: Any, loss: Any, max_new_tokens: int) -> tuple[Any, Any]:
    """(Loss, the trainer's loss_fn): the launcher's already-checked loss when it passed one."""
    from megatron_flash.trainer.loss_adapter import aggregation_norm, build_loss, make_loss_fn

    loss = loss if loss is not None else build_loss(loss_cfg)
    return loss, make_loss_fn(loss, aggregation=loss_cfg.aggregation,
                              norm=aggregation_norm(loss_cfg, max_new_tokens))


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
