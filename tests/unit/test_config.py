"""Config schema, loader and the launcher's config front door (no torch needed)."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest

from megatron_flash.config import ConfigError, RunConfig, config_to_yaml, flat_keys, load_config
from megatron_flash.config import schema

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = REPO_ROOT / "launch" / "pretrain_async_rl.py"
QUICKSTART = REPO_ROOT / "configs" / "quickstart_cpu.yaml"


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(config_path: Any = None, overrides: List[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config_path, list(overrides))
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --------------------------------------------------------------------------- schema

# Keys and defaults other modules rely on (the contract); extra fields may exist.
CONTRACT = {
    "model.hf_path": "", "model.dtype": "float32", "model.make_vocab_size_divisible_by": 128,
    "model.use_transformer_engine": "auto",
    "parallel.tensor_model_parallel_size": 1, "parallel.pipeline_model_parallel_size": 1,
    "parallel.sequence_parallel": False, "parallel.backend": "auto",
    "parallel.virtual_pipeline_model_parallel_size": None,
    "trainer.total_steps": 100, "trainer.micro_batch_size": 4, "trainer.global_batch_size": 64,
    "trainer.num_epochs": 1, "trainer.num_mini_batches": 1, "trainer.seed": 1234,
    "trainer.max_seq_len": 512,
    "optimizer.name": "adam", "optimizer.lr": 1e-6, "optimizer.min_lr": 0.0,
    "optimizer.weight_decay": 0.0, "optimizer.adam_beta1": 0.9, "optimizer.adam_beta2": 0.999,
    "optimizer.adam_eps": 1e-8, "optimizer.clip_grad": 1.0, "optimizer.lr_warmup_steps": 0,
    "optimizer.lr_decay_style": "constant", "optimizer.use_distributed_optimizer": False,
    "loss.name": "decoupled_ppo", "loss.params": {}, "loss.aggregation": "token_mean", "loss.advantage": "grpo",
    "loss.advantage_std_normalize": True, "loss.kl_coef": 0.0, "loss.kl_estimator": "k3",
    "rollout.n_samples_per_prompt": 8, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
    "rollout.top_k": -1, "rollout.max_new_tokens": 256, "rollout.prompt_replication": True,
    "rollout.replication_chunk": 1,
    "rollout.extra_prompts": 0, "rollout.dynamic_filter": "none", "rollout.pause_mode": "retract",
    "rollout.reward": "exact_match",
    "async_rl.alpha": 2, "async_rl.stale_policy": "drop", "async_rl.admission": "tokens",
    "async_rl.min_lookahead": 1.0,
    "trainer.version_check_interval": 4,
    "engines.backend": "local", "engines.num_engines": 1, "engines.urls": [], "engines.host": "127.0.0.1",
    "engines.base_port": 30000, "engines.tp_size": 1, "engines.gpu_ids": [],
    "engines.max_inflight_per_engine": 64, "engines.startup_timeout_s": 300.0,
    "engines.request_timeout_s": 600.0, "engines.server_args": {}, "engines.api_key": None,
    "engines.max_restarts": 3, "engines.colocate": False,
    "weight_sync.transport": "ipc", "weight_sync.bucket_mb": 512, "weight_sync.probe": True,
    "weight_sync.probe_threshold": None,
    "data.path": "", "data.prompt_key": "prompt", "data.answer_key": "answer", "data.task": "",
    "data.num_samples": 0, "data.shuffle": True,
    "logging.dir": "runs/default", "logging.wandb_mode": "offline", "logging.wandb_project": "megatron-flash",
    "logging.tensorboard": True, "logging.log_interval": 1,
    "checkpoint.save_dir": "", "checkpoint.save_interval": 0, "checkpoint.resume": False,
    "checkpoint.save_hf_at_end": True,
}


def _get(cfg: RunConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_defaults_validate_and_match_contract() -> None:
    cfg = RunConfig()
    cfg.validate()
    assert load_config(None, []) == cfg
    assert set(CONTRACT) <= set(flat_keys())
    for key, default in CONTRACT.items():
        assert _get(cfg, key) == default, key


SCHEMA_FILES = [Path(schema.__file__), *sorted((Path(schema.__file__).parent / "sections").glob("*.py"))]


def test_every_field_has_a_docstring() -> None:
    missing, classes = [], 0
    for cls in (node for path in SCHEMA_FILES for node in ast.parse(path.read_text(encoding="utf-8")).body
                if isinstance(node, ast.ClassDef)):
        classes += 1
        body = cls.body
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.AnnAssign) or "ClassVar" in ast.unparse(stmt.annotation):
                continue
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str) and nxt.value.value.strip())
            if not documented:
                missing.append(f"{cls.name}.{ast.unparse(stmt.target)}")
    assert not missing, f"fields without a docstring: {missing}"
    assert classes >= 18  # RunConfig, ModeTraits, _Section and a dataclass per section were all read


def test_the_schema_is_a_module_per_section() -> None:
    """One module per section, each small; every RunConfig section's class lives in its own module."""
    sections = Path(schema.__file__).parent / "sections"
    for f in dataclasses.fields(RunConfig):
        cls = type(getattr(RunConfig(), f.name))
        assert cls.__module__ == f"megatron_flash.config.sections.{f.name}", (f.name, cls.__module__)
    for path in SCHEMA_FILES:
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 400, path


# --------------------------------------------------------------------------- loading

def test_yaml_then_override_precedence(tmp_path: Path) -> None:
    path = _write(tmp_path, "optimizer:\n  lr: 1e-3\n  weight_decay: 0.1\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(str(path), ["optimizer.lr=2e-3", "loss.params.eps_high=0.28"])
    assert cfg.optimizer.lr == 2e-3  # override beats YAML
    assert cfg.optimizer.weight_decay == 0.1  # YAML beats default
    assert cfg.trainer.total_steps == 7
    assert cfg.trainer.micro_batch_size == 4  # untouched default
    assert cfg.loss.params == {"eps_high": 0.28}


def test_files_compose_left_to_right(tmp_path: Path) -> None:
    second = _write(tmp_path, "optimizer:\n  lr: 5.0e-4\nloss:\n  name: tis\n", "second.yaml")
    cfg = load_config([QUICKSTART, second], ["trainer.total_steps=3"])
    assert cfg.data.task == "sort4" and cfg.loss.name == "tis"
    assert cfg.optimizer.lr == 5e-4 and cfg.trainer.total_steps == 3


def test_free_form_mappings_accept_any_key_and_merge(tmp_path: Path) -> None:
    path = _write(tmp_path, "engines:\n  backend: sglang\n  server_args:\n    mem-fraction-static: 0.8\n")
    cfg = load_config(path, ["engines.server_args.chunked-prefill-size=4096", "loss.params.nested.a=1"])
    assert cfg.engines.server_args == {"mem-fraction-static": 0.8, "chunked-prefill-size": 4096}
    assert cfg.loss.params == {"nested": {"a": 1}}


def test_override_values_are_parsed_as_yaml() -> None:
    cfg = load_config(None, ["engines.backend=sglang", "engines.num_engines=2", "engines.gpu_ids=[2,3]",
                             "parallel.virtual_pipeline_model_parallel_size=null", "data.path=",
                             "model.use_transformer_engine=false", "optimizer.lr=1e-5"])
    assert cfg.engines.gpu_ids == [2, 3]
    assert cfg.parallel.virtual_pipeline_model_parallel_size is None
    assert cfg.data.path == ""
    assert cfg.model.use_transformer_engine == "false"  # a YAML bool, normalised
    assert cfg.optimizer.lr == 1e-5


def test_empty_yaml_and_empty_section_mean_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "# nothing yet\n"), []) == RunConfig()
    assert load_config(_write(tmp_path, "trainer:\n  # total_steps: 3\n", "b.yaml"), []) == RunConfig()


# --------------------------------------------------------------------------- errors

def test_unknown_override_key_suggests_closest() -> None:
    message = _error(None, ["loss.nmae=x"])
    assert "unknown config key 'loss.nmae' (did you mean 'loss.name'?)" in message
    assert "loss.nmae=x" in message


def test_misspelled_section_suggests_full_key(tmp_path: Path) -> None:
    assert "unknown config key 'los.name' (did you mean 'loss.name'?)" in _error(None, ["los.name=x"])
    path = _write(tmp_path, "los:\n  name: tis\n")
    message = _error(path)
    assert "'los.name' (did you mean 'loss.name'?)" in message and str(path) in message


@pytest.mark.parametrize("typo, meant", [
    ("trainer.total_step", "trainer.total_steps"),
    ("trainer.lr", "optimizer.lr"),  # right field, wrong section
    ("async.alpha", "async_rl.alpha"),  # the Python-keyword section
    ("rollout.n", "rollout.n_samples_per_prompt"),
    ("optimizer.warmup", "optimizer.lr_warmup_steps"),
])
def test_suggestions(typo: str, meant: str) -> None:
    assert f"unknown config key '{typo}' (did you mean '{meant}'?)" in _error(None, [f"{typo}=1"])


def test_unknown_key_without_close_match_lists_section_fields() -> None:
    message = _error(None, ["trainer.zzzz=1"])
    assert "unknown config key 'trainer.zzzz'" in message and "total_steps" in message


def test_unknown_yaml_key_names_file_and_full_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  total_steps: 3\nrollout:\n  n_sample_per_prompt: 4\n")
    message = _error(path)
    assert "'rollout.n_sample_per_prompt' (did you mean 'rollout.n_samples_per_prompt'?)" in message
    assert str(path) in message


def test_dotted_yaml_key_is_rejected(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "trainer.total_steps: 5\n"))
    assert "trainer.total_steps" in message and "nest" in message


@pytest.mark.parametrize("override, expected", [
    ("trainer.total_steps=abc", ["'trainer.total_steps'", "int", "'abc'"]),
    ("optimizer.lr=fast", ["'optimizer.lr'", "float", "'fast'"]),
    ("parallel.sequence_parallel=maybe", ["'parallel.sequence_parallel'", "bool", "'maybe'"]),
    ("engines.gpu_ids=[a]", ["'engines.gpu_ids'", "list of int"]),
    ("loss.params=3", ["'loss.params'", "mapping"]),
    ("trainer.seed=null", ["'trainer.seed'", "int", "None"]),
    ("engines.server_args=[1]", ["'engines.server_args'", "mapping", "[1]"]),
    ("engines.urls=http://x:1", ["'engines.urls'", "list of str"]),
    ("data.path=[a]", ["'data.path'", "str", "['a']"]),
])
def test_wrong_type_names_key_type_and_value(override: str, expected: List[str]) -> None:
    message = _error(None, [override])
    for part in expected:
        assert part in message, (part, message)


def test_any_value_for_any_key_gives_config_error_or_config() -> None:
    # The launcher catches ConfigError only: nothing else may escape for any user input.
    for key in flat_keys():
        for value in ("[1]", "{a: 1}", "abc", "null", "-1", "1.5", "true", "${nope}"):
            try:
                load_config(None, [f"{key}={value}"])
            except ConfigError as err:
                assert key in str(err) and "\n" not in str(err), (key, value, str(err))


def test_wrong_type_in_yaml_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  micro_batch_size: four\n")
    message = _error(path)
    assert "'trainer.micro_batch_size' expects int, got 'four'" in message and str(path) in message


def test_section_given_a_scalar() -> None:
    assert "'trainer' must be a mapping" in _error(None, ["trainer=3"])


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "# header\ntrainer:\n  total_steps: 5\n   micro_batch_size: 2\n")
    message = _error(path)
    assert str(path) in message and "line 4" in message


def test_yaml_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "optimizer:\n  lr: 1.0\n  lr: 2.0\n")
    message = _error(path)
    assert "duplicate key 'lr'" in message and "line 3" in message


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert str(path) in _error(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_top_level_names_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert str(path) in message and "mapping" in message


@pytest.mark.parametrize("item", ["trainer.total_steps", "=3", "trainer..seed=1"])
def test_malformed_override_is_named(item: str) -> None:
    assert f"'{item}'" in _error(None, [item])


def test_unresolvable_interpolation_names_key() -> None:
    message = _error(None, ["engines.api_key=${oc.env:MF_SURELY_UNSET_VAR_1234}"])
    assert "engines.api_key" in message and "MF_SURELY_UNSET_VAR_1234" in message


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides, expected", [
    (["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size must be >= 1, got 0"),
    (["trainer.micro_batch_size=5", "trainer.pack_sequences=false"],
     "trainer.global_batch_size must be divisible by trainer.micro_batch_size=5, got 64"),
    (["trainer.global_batch_size=60", "trainer.micro_batch_size=4"],
     "trainer.global_batch_size must be divisible by rollout.n_samples_per_prompt=8"),
    (["rollout.max_new_tokens=512"], "rollout.max_new_tokens must be < trainer.max_seq_len=512"),
    (["rollout.n_samples_per_prompt=1", "trainer.global_batch_size=4"],
     "rollout.n_samples_per_prompt must be >= 2 with loss.advantage=grpo"),
    (["optimizer.lr=0"], "optimizer.lr must be > 0, got 0.0"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr must be <= optimizer.lr"),
    (["optimizer.adam_beta2=1.0"], "optimizer.adam_beta2 must be in [0, 1)"),
    (["rollout.top_p=0"], "rollout.top_p must be in (0, 1]"),
    (["rollout.top_k=0"], "rollout.top_k must be -1 (disabled) or >= 1, got 0"),
    (["rollout.replication_chunk=9"], "rollout.replication_chunk must be <= n_samples_per_prompt (8)"),
    (["rollout.replication_chunk=0"], "rollout.replication_chunk must be >= 1, got 0"),
    (["async_rl.alpha=-1"], "async_rl.alpha must be >= 0, got -1"),
    (["async_rl.admission=lazy"], "async_rl.admission must be one of"),
    (["async_rl.alpha=0", "async_rl.admission=eager"], "async_rl.admission='eager' needs async_rl.alpha >= 1"),
    (["async_rl.admission=tokens", "async_rl.min_lookahead=-0.5"], "async_rl.min_lookahead must be >= 0.0, got -0.5"),
    (["async_rl.admission=tokens", "async_rl.min_lookahead=3"],
     "async_rl.min_lookahead must be <= async_rl.alpha (2), got 3.0"),
    (["async_rl.admission=adaptive", "async_rl.min_lookahead=0.5"],
     "async_rl.min_lookahead is used only with async_rl.admission=tokens (got admission='adaptive'), got 0.5"),
    (["trainer.version_check_interval=-1"], "trainer.version_check_interval must be >= 0, got -1"),
    (["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1"),
    (["parallel.virtual_pipeline_model_parallel_size=2"],
     "parallel.virtual_pipeline_model_parallel_size needs parallel.pipeline_model_parallel_size > 1"),
    (["engines.backend=attach"], "engines.urls must list the engine URLs"),
    (["engines.backend=attach", "engines.urls=[http://a:1,http://b:2]"], "engines.num_engines must equal"),
    (["engines.urls=[http://a:1]"], "engines.urls is only used with engines.backend=attach"),
    (["engines.backend=sglang", "engines.gpu_ids=[0,1,2]"], "engines.gpu_ids must hold"),
    (["engines.tp_size=2"], "engines.tp_size must be 1 with engines.backend=local"),
    (["engines.max_restarts=-1"], "engines.max_restarts must be >= 0"),
    (["engines.colocate=true"], "async_rl.alpha must be 0 with engines.colocate=true"),
    (["engines.server_args.port=31000"], "engines.server_args.port is set from engines.base_port"),
    (["loss.params.kl_coef=0.1"], "loss.params.kl_coef duplicates loss.kl_coef"),
    (["checkpoint.save_interval=10"], "checkpoint.save_dir must be set when checkpoint.save_interval > 0"),
])
def test_validation_errors_name_the_key(overrides: List[str], expected: str) -> None:
    message = _error(None, overrides)
    assert expected in message, message


ENUMS = [
    ("model.dtype", schema.DTYPES), ("model.use_transformer_engine", schema.TRI_STATE),
    ("parallel.backend", schema.DIST_BACKENDS), ("optimizer.name", schema.OPTIMIZERS),
    ("optimizer.lr_decay_style", schema.LR_DECAY_STYLES), ("loss.aggregation", schema.AGGREGATIONS),
    ("loss.advantage", schema.ADVANTAGES), ("loss.kl_estimator", schema.KL_ESTIMATORS),
    ("rollout.dynamic_filter", schema.DYNAMIC_FILTERS), ("rollout.pause_mode", schema.PAUSE_MODES),
    ("rollout.runner", schema.ROLLOUT_RUNNERS),
    ("async_rl.stale_policy", schema.STALE_POLICIES), ("engines.backend", schema.ENGINE_BACKENDS),
    ("weight_sync.transport", schema.WEIGHT_TRANSPORTS), ("logging.wandb_mode", schema.WANDB_MODES),
]


@pytest.mark.parametrize("key, choices", ENUMS, ids=[key for key, _ in ENUMS])
def test_enum_fields_list_their_choices(key: str, choices: tuple) -> None:
    message = _error(None, [f"{key}=bogus"])
    assert f"{key} must be one of {'|'.join(choices)}, got 'bogus'" in message
    section, name = key.split(".")
    for choice in choices:  # every listed choice passes the choice check (others may still fire)
        obj = dataclasses.replace(getattr(RunConfig(), section), **{name: choice})
        try:
            obj.validate()
        except ValueError as err:
            assert "must be one of" not in str(err), err


def test_validation_error_is_a_value_error_with_key() -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, ["trainer.total_steps=0"])
    assert isinstance(info.value, ConfigError) and info.value.key == "trainer.total_steps"


# --------------------------------------------------------------------------- printing

def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART, ["loss.params.eps_high=0.28", "trainer.seed=7",
                                   "model.use_transformer_engine=true", "rollout.top_k=20"])
    path = _write(tmp_path, config_to_yaml(cfg), "resolved.yaml")
    assert load_config(path, []) == cfg
    with_secret = load_config(path, ["engines.api_key=abc"])
    path = _write(tmp_path, config_to_yaml(with_secret, redact=False), "exact.yaml")
    assert load_config(path, []) == with_secret


def test_secrets_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MF_TEST_API_KEY", "s3cret")
    cfg = load_config(None, ["engines.api_key=${oc.env:MF_TEST_API_KEY}"])
    assert cfg.engines.api_key == "s3cret"
    assert "s3cret" not in config_to_yaml(cfg)
    assert "s3cret" in config_to_yaml(cfg, redact=False)


# --------------------------------------------------------------------------- launcher

HEAVY = ("torch", "megatron", "transformers")


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-X", "importtime", str(LAUNCHER), *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def _imported(stderr: str) -> List[str]:
    # -X importtime lines: "import time: self [us] | cumulative | <indent>module"
    return [line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")]


def _heavy(modules: List[str]) -> List[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY]


def _messages(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


def test_launcher_bad_key_exits_2_before_torch() -> None:
    proc = _launch("--config", "configs/quickstart_cpu.yaml", "loss.nmae=x")
    messages = _messages(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did you mean 'loss.name'" in messages
    assert "Traceback" not in messages
    modules = _imported(proc.stderr)
    assert "omegaconf" in modules  # the importtime probe works
    assert not _heavy(modules), _heavy(modules)


def test_launcher_print_config_reloads_equal(tmp_path: Path) -> None:
    proc = _launch("--config", "configs/quickstart_cpu.yaml", "--print-config", "trainer.seed=9")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not _heavy(_imported(proc.stderr))
    path = _write(tmp_path, proc.stdout, "printed.yaml")
    assert load_config(path, []) == load_config(QUICKSTART, ["trainer.seed=9"])


def test_launcher_malformed_override_exits_2() -> None:
    proc = _launch("--config", "configs/quickstart_cpu.yaml", "trainer.total_steps")
    assert proc.returncode == 2 and "'trainer.total_steps'" in _messages(proc.stderr)


def test_recipe_fields_are_refused_where_they_would_do_nothing() -> None:
    assert "loss.aggregation_norm=16 is only used with loss.aggregation=seq_mean_token_sum_norm" in _error(
        QUICKSTART, ["loss.aggregation=seq_mean_token_sum", "loss.aggregation_norm=16"])
    assert "checkpoint.save_hf_interval=5: trainer.mode=rollout_only trains nothing" in _error(
        QUICKSTART, ["trainer.mode=rollout_only", "checkpoint.save_hf_interval=5"])
    assert "rollout.overlong_penalty=0.5 is only used with rollout.overlong_buffer_len > 0" in _error(
        QUICKSTART, ["rollout.overlong_penalty=0.5"])
    assert "rollout.overlong_buffer_len" in _error(QUICKSTART, ["rollout.overlong_buffer_len=8"])  # = max_new_tokens
    assert "not built for agentic episodes" in _error(
        REPO_ROOT / "configs" / "agentic_frozenlake_cpu.yaml", ["rollout.overlong_filter=true"])
    assert "rollout.runner=process is not built for agentic episodes" in _error(
        REPO_ROOT / "configs" / "agentic_frozenlake_cpu.yaml", ["rollout.runner=process"])
    cfg = load_config(QUICKSTART, ["loss.name=gspo", "loss.aggregation=seq_mean_token_sum_norm",
                                   "loss.aggregation_norm=16", "checkpoint.save_hf_interval=5"])
    assert cfg.loss.aggregation_norm == 16 and cfg.checkpoint.save_hf_interval == 5


def test_eval_section_refuses_what_it_cannot_use() -> None:
    assert "eval.every_steps is set but eval.datasets is empty" in _error(QUICKSTART, ["eval.every_steps=5"])
    assert "eval.datasets.held.split is not a data field" in _error(
        QUICKSTART, ["eval.datasets={held: {task: sort4, split: test}}"])
    assert "eval.datasets.held needs a path or a task" in _error(QUICKSTART, ["eval.datasets={held: {num_samples: 4}}"])
    assert "evaluation runs in trainer.mode=full" in _error(
        QUICKSTART, ["eval.datasets={held: {task: sort4}}", "trainer.mode=rollout_only"])


def test_admission_names_are_defined_once() -> None:
    """The rules' names live in the config; the staleness module that implements them and the planner
    use that very tuple."""
    from megatron_flash.buffer.staleness import ADMISSIONS as RULES
    from megatron_flash.config.schema import ADMISSIONS
    from megatron_flash.planner import ADMISSIONS as PLANNED

    assert ADMISSIONS is RULES is PLANNED == ("tokens", "adaptive", "eager")


def test_override_with_a_mapping_replaces_a_free_form_mapping() -> None:
    """A file merges into a mapping; `key={...}` on the command line replaces it (so `{}` clears it),
    `key.entry=v` sets one entry, and `~key.entry` deletes one."""
    path = REPO_ROOT / "configs" / "smollm2_arith_cpu.yaml"
    base = ["model.hf_path=/m"]
    assert load_config(path, base).engines.server_args == {"max_running_requests": 32, "context_length": 160}
    assert load_config(path, base + ["engines.server_args={}"]).engines.server_args == {}
    assert load_config(path, base + ["engines.server_args={dtype: bfloat16}"]).engines.server_args == {"dtype": "bfloat16"}
    assert load_config(path, base + ["engines.server_args.dtype=bfloat16"]).engines.server_args == {
        "max_running_requests": 32, "context_length": 160, "dtype": "bfloat16"}
    assert load_config(path, base + ["~engines.server_args.context_length"]).engines.server_args == {
        "max_running_requests": 32}
    # a later override still adds to a replaced mapping, in command-line order
    assert load_config(path, base + ["engines.server_args={}", "engines.server_args.a=1"]).engines.server_args == {"a": 1}
    # the multi-node template's clear makes a config with engine flags attachable
    attach = ["engines.backend=attach", "engines.urls=[http://h:1]", "engines.server_args={}"]
    assert load_config(path, base + attach).engines.backend == "attach"
    with pytest.raises(ConfigError, match="engines.server_args must be empty with engines.backend=attach"):
        load_config(path, base + attach[:2])


def test_tilde_puts_a_field_back_to_its_default_and_names_what_is_missing() -> None:
    cfg = load_config(None, ["model.hf_path=/m", "optimizer.lr=0.5", "~optimizer.lr"])
    assert cfg.optimizer.lr == schema.OptimizerConfig().lr
    with pytest.raises(ConfigError, match=r"engines.server_args has no entry 'nope' to delete \(it has: nothing\)"):
        load_config(None, ["~engines.server_args.nope"])
    with pytest.raises(ConfigError, match="unknown config key 'optimizer.lrr'"):
        load_config(None, ["~optimizer.lrr"])
    with pytest.raises(ConfigError, match="~ takes a key and no value"):
        load_config(None, ["~optimizer.lr=3"])
