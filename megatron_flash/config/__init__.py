"""Run configuration: typed schema (``schema``) and YAML + ``key=value`` loading (``loader``).

Imports only omegaconf and yaml, so launchers can validate a config before importing torch.
"""

from megatron_flash.config.loader import ConfigError, config_to_yaml, flat_keys, load_config
from megatron_flash.config.schema import (
    AsyncConfig,
    CheckpointConfig,
    DataConfig,
    EngineConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    WeightSyncConfig,
)

__all__ = [
    "AsyncConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "config_to_yaml",
    "flat_keys",
    "load_config",
]
