"""No silent options: every field of the `parallel` and `trainer` sections changes what Megatron (or the
controller) receives, or is rejected with an error naming it (against a dense model; the expert
fields are also checked against a mixture-of-experts one).

For each field the test sets a non-default value (ALTERNATIVES; a new field without an entry fails
here, so nobody can add one without deciding what it does) and then either
  * loading/validating the config, or the trainer's own checks of what the installed stack can do
    (layout divisibility, TE-only features), raises ValueError naming the field, or
  * what the trainer hands to Megatron — TransformerConfig's arguments, the parallel-state
    initialisation, the micro-batch plan settings, seed and schedule length — differs from the
    defaults' (computed without building a model: no Megatron import needed), or
  * the field is one the controller consumes (CONTROLLER_FIELDS), and the controller reads it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_flash.config import ConfigError, load_config
from megatron_flash.config.schema import ParallelConfig, TrainerConfig
from megatron_flash.trainer.model_builder import (
    check_scale_options,
    transformer_config_kwargs,
    use_te,
    validate_layout,
)
from megatron_flash.trainer.policy import PolicySettings
from megatron_flash.hf.spec import HFModelSpec, MoESpec

REPO = Path(__file__).resolve().parents[2]
SPEC = HFModelSpec(family="llama", architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                   ffn_hidden_size=128, num_layers=8, num_attention_heads=8, num_query_groups=4, head_dim=8,
                   norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                   qkv_bias=False, qk_norm=False)
MOE_SPEC = dataclasses.replace(SPEC, family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                               moe=MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True,
                                           aux_loss_coef=0.001))
BASE = ["model.hf_path=/unused", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16"]

# field → overrides that set it to a non-default value (plus what it needs to pass the schema)
ALTERNATIVES: dict[str, list[str]] = {
    "parallel.tensor_model_parallel_size": ["parallel.tensor_model_parallel_size=2"],
    "parallel.pipeline_model_parallel_size": ["parallel.pipeline_model_parallel_size=2"],
    "parallel.sequence_parallel": ["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"],
    "parallel.backend": ["parallel.backend=gloo"],
    "parallel.collective_timeout_s": ["parallel.collective_timeout_s=60"],
    "parallel.virtual_pipeline_model_parallel_size": ["parallel.virtual_pipeline_model_parallel_size=2",
                                                      "parallel.pipeline_model_parallel_size=2"],
    "parallel.context_parallel_size": ["parallel.context_parallel_size=2"],
    "parallel.expert_model_parallel_size": ["parallel.expert_model_parallel_size=2"],
    "parallel.expert_tensor_parallel_size": ["parallel.expert_tensor_parallel_size=2"],
    "trainer.total_steps": ["trainer.total_steps=7"],
    "trainer.micro_batch_size": ["trainer.micro_batch_size=2"],
    "trainer.global_batch_size": ["trainer.global_batch_size=32"],
    "trainer.num_epochs": ["trainer.num_epochs=2"],
    "trainer.num_mini_batches": ["trainer.num_mini_batches=2"],
    "trainer.seed": ["trainer.seed=5"],
    "trainer.max_seq_len": ["trainer.max_seq_len=1024"],
    "trainer.mode": ["trainer.mode=rollout_only"],
    "trainer.replay_path": ["trainer.replay_path=groups.jsonl"],
    "trainer.pack_sequences": ["trainer.pack_sequences=false"],
    "trainer.max_tokens_per_micro_batch": ["trainer.max_tokens_per_micro_batch=256"],
    "trainer.shared_prefix": ["trainer.shared_prefix=true"],
    "trainer.recompute": ["trainer.recompute=selective"],
    "trainer.recompute_method": ["trainer.recompute_method=block"],
    "trainer.recompute_num_layers": ["trainer.recompute_num_layers=2"],
    "trainer.moe_routing_replay": ["trainer.moe_routing_replay=rollout"],
    "trainer.max_nonfinite_steps": ["trainer.max_nonfinite_steps=1"],
    "trainer.version_check_interval": ["trainer.version_check_interval=1"],
}
# Consumed by the controller's loop (batching of rollout data, run mode), not by Megatron.
CONTROLLER_FIELDS = {"trainer.global_batch_size", "trainer.num_epochs", "trainer.num_mini_batches",
                     "trainer.mode", "trainer.replay_path", "trainer.max_nonfinite_steps",
                     "trainer.version_check_interval"}
# Combinations that must be accepted and reach Megatron (the rejections above are single fields).
ACCEPTED = {
    "recompute full, block, 2 layers": ["trainer.recompute=full", "trainer.recompute_method=block",
                                        "trainer.recompute_num_layers=2"],
    "packed by budget": ["trainer.max_tokens_per_micro_batch=4096"],
    "padded": ["trainer.pack_sequences=false"],
    "shared prefixes by budget": ["trainer.shared_prefix=true", "trainer.max_tokens_per_micro_batch=4096"],
}


def megatron_view(overrides: list[str], spec: HFModelSpec = SPEC) -> dict[str, Any]:
    """What the trainer would hand to Megatron for this config (raises ValueError on a rejection)."""
    cfg = load_config(None, BASE + overrides)
    s = PolicySettings.from_sections(model=cfg.model, parallel=cfg.parallel, trainer=cfg.trainer, optimizer=cfg.optimizer)
    validate_layout(spec, tp_size=s.tp_size, pp_size=s.pp_size, vpp_size=s.scale.virtual_pipeline_size, moe=s.moe,
                    sequence_parallel=s.scale.sequence_parallel, recompute=s.scale.recompute)
    uses_te = use_te(s.use_transformer_engine)
    check_scale_options(s.scale, optimizer=s.optimizer, uses_te=uses_te, moe=spec.moe is not None)
    return {
        "TransformerConfig": transformer_config_kwargs(spec, tp_size=s.tp_size, pp_size=s.pp_size, dtype=s.dtype,
                                                       scale=s.scale, moe=s.moe),
        "initialize_model_parallel": (s.tp_size, s.pp_size, s.scale.virtual_pipeline_size,
                                      s.scale.context_parallel_size, s.backend, s.seed, s.collective_timeout_s,
                                      s.moe.ep_size, s.moe.etp_size),
        "micro_batches": (s.pack_sequences, s.micro_batch_size, s.max_tokens_per_micro_batch, s.max_seq_len,
                          s.shared_prefix),
        "scheduler": s.optimizer_steps,
        "router_replay": s.moe.routing_replay,  # the routers' replay action (trainer/routing_replay.py)
    }


def section_fields() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in (("parallel", ParallelConfig), ("trainer", TrainerConfig))
            for f in dataclasses.fields(cls)]


def test_every_field_has_an_alternative() -> None:
    missing = sorted(set(section_fields()) - set(ALTERNATIVES))
    assert not missing, f"new fields need an entry in ALTERNATIVES (and a consumer): {missing}"


@pytest.mark.parametrize("key", section_fields())
def test_field_changes_what_runs_or_is_rejected(key: str) -> None:
    default = megatron_view([])
    try:
        view = megatron_view(ALTERNATIVES[key])
    except (ConfigError, ValueError) as e:
        assert key in str(e), f"{key}: rejected, but the error does not name it: {e}"
        return
    if key in CONTROLLER_FIELDS:
        name = key.split(".", 1)[1]
        source = "".join(p.read_text() for p in sorted((REPO / "megatron_flash" / "controller").glob("*.py")))
        assert f".{name}" in source, f"{key} is said to be the controller's, but controller/ never reads it"
        return
    changed = [part for part in view if view[part] != default[part]]
    assert changed, f"{key}={ALTERNATIVES[key]} changes nothing the trainer hands to Megatron (a silent option)"


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_valid_combinations_reach_megatron(name: str) -> None:
    assert megatron_view(ACCEPTED[name]) != megatron_view([])


def test_recompute_reaches_transformer_config() -> None:
    full = megatron_view(ACCEPTED["recompute full, block, 2 layers"])["TransformerConfig"]
    assert (full["recompute_granularity"], full["recompute_method"], full["recompute_num_layers"]) == ("full", "block", 2)
    assert megatron_view(["trainer.recompute=selective"])["TransformerConfig"]["recompute_granularity"] == "selective"


def test_scale_errors_name_the_field_and_the_reason() -> None:
    with pytest.raises(ValueError, match="parallel.context_parallel_size=2 with a mixture-of-experts model is not built"):
        megatron_view(["parallel.context_parallel_size=2"], MOE_SPEC)
    for extra, reason in ((["trainer.shared_prefix=true"], "with trainer.shared_prefix=true is not built"),
                          (["trainer.pack_sequences=false"], "needs trainer.pack_sequences=true"),
                          (["model.use_transformer_engine=true"], "runs on the local layer spec")):
        with pytest.raises(ConfigError, match="parallel.context_parallel_size=2 " + reason):
            load_config(None, BASE + ["parallel.context_parallel_size=2"] + extra)
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch needs trainer.pack_sequences=true"):
        megatron_view(["trainer.max_tokens_per_micro_batch=64", "trainer.pack_sequences=false"])
    with pytest.raises(ValueError, match="trainer.recompute_method is only used with trainer.recompute=full"):
        megatron_view(["trainer.recompute_method=block", "trainer.recompute=selective"])


def test_expert_fields_reach_megatron_for_a_moe_model() -> None:
    default = megatron_view([], MOE_SPEC)["TransformerConfig"]
    assert (default["num_moe_experts"], default["moe_router_topk"], default["moe_router_pre_softmax"]) == (8, 2, False)
    ep = megatron_view(["parallel.expert_model_parallel_size=2", "model.moe_aux_loss_coeff=0"], MOE_SPEC)
    assert ep["TransformerConfig"]["expert_model_parallel_size"] == 2 and ep["initialize_model_parallel"][-2] == 2
    etp = megatron_view(["parallel.expert_tensor_parallel_size=2"], MOE_SPEC)
    assert etp["TransformerConfig"]["expert_tensor_parallel_size"] == 2
    aux = megatron_view(["model.moe_aux_loss_coeff=0.01"], MOE_SPEC)["TransformerConfig"]
    assert aux["moe_aux_loss_coeff"] == 0.01 and default["moe_aux_loss_coeff"] == 0.001
    assert default["moe_token_dispatcher_type"] == ("alltoall" if torch.cuda.is_available() else "allgather")
    if torch.cuda.is_available():
        assert megatron_view(["model.moe_token_dispatcher=alltoall"], MOE_SPEC)["TransformerConfig"][
            "moe_token_dispatcher_type"] == "alltoall"
    else:
        with pytest.raises(ValueError, match="model.moe_token_dispatcher=alltoall needs CUDA"):
            megatron_view(["model.moe_token_dispatcher=alltoall"], MOE_SPEC)


def test_moe_layout_rules_name_what_failed() -> None:
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by parallel.expert_model_parallel_size=3"):
        megatron_view(["parallel.expert_model_parallel_size=3", "model.moe_aux_loss_coeff=0"], MOE_SPEC)
    for packing in ("true", "false"):  # the load-balancing loss works with EP, packed or padded
        ep = megatron_view(["parallel.expert_model_parallel_size=2", f"trainer.pack_sequences={packing}"], MOE_SPEC)
        assert ep["TransformerConfig"]["moe_aux_loss_coeff"] == 0.001
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible by "
                                         "parallel.expert_tensor_parallel_size=3"):
        megatron_view(["parallel.expert_tensor_parallel_size=3"], MOE_SPEC)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 with a mixture-of-experts model needs "
                                         "parallel.sequence_parallel=true"):
        megatron_view(["parallel.tensor_model_parallel_size=2"], MOE_SPEC)
    assert megatron_view(["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
                         MOE_SPEC)["TransformerConfig"]["sequence_parallel"] is True
    with pytest.raises(ValueError, match="model.moe_aux_loss_coeff=0.01 needs a mixture-of-experts model"):
        megatron_view(["model.moe_aux_loss_coeff=0.01"])


def test_routing_replay_reaches_the_routers_and_refuses_what_would_replay_wrong() -> None:
    assert megatron_view(["trainer.moe_routing_replay=rollout"], MOE_SPEC)["router_replay"] is True
    assert megatron_view([], MOE_SPEC)["TransformerConfig"]["moe_enable_routing_replay"] is True
    with pytest.raises(ValueError, match="trainer.moe_routing_replay=rollout needs a mixture-of-experts model"):
        megatron_view(["trainer.moe_routing_replay=rollout"])
    with pytest.raises(ValueError, match="trainer.moe_routing_replay=rollout with trainer.recompute=full and "
                                         "parallel.pipeline_model_parallel_size=2"):
        megatron_view(["trainer.moe_routing_replay=rollout", "trainer.recompute=full",
                       "parallel.pipeline_model_parallel_size=2"], MOE_SPEC)
    megatron_view(["trainer.moe_routing_replay=rollout", "trainer.recompute=full"], MOE_SPEC)  # PP1: fine
