"""One typed config tree. Import sections and the loader from here.

``loader.py`` holds the machinery (param, load_config, ConfigError); each other module holds the
sections of one part of the system. A new section goes in the module of the part that owns it
and is re-exported here.
"""

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import (
    BaseExperimentConfig,
    GenerationHyperparameters,
    MicroBatchSpec,
    OptimizerConfig,
    RecoverConfig,
    StatsLoggerConfig,
    TimerConfig,
)
from areal.api.config.data import ArithmeticConfig, DatasetConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.experiments import DPOConfig, DPOLossConfig, GRPOConfig, RWConfig, SFTConfig
from areal.api.config.launcher import ClusterConfig, LauncherConfig, NameResolveConfig
from areal.api.config.loader import (
    ConfigError,
    from_dict,
    iter_fields,
    load_config,
    param,
    parse_overrides,
    read_yaml,
    save_config,
    to_dict,
)
from areal.api.config.reward import RewardConfig, SandboxConfig, WorkflowConfig
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.config.server import GenerationServerConfig
from areal.api.config.tinker import TinkerConfig

__all__ = [
    "ArithmeticConfig",
    "BaseExperimentConfig",
    "ClusterConfig",
    "ConfigError",
    "DPOConfig",
    "DPOLossConfig",
    "DatasetConfig",
    "GRPOConfig",
    "GenerationHyperparameters",
    "GenerationServerConfig",
    "InferenceEngineConfig",
    "LauncherConfig",
    "MicroBatchSpec",
    "NameResolveConfig",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RWConfig",
    "RecoverConfig",
    "RewardConfig",
    "SFTConfig",
    "SandboxConfig",
    "StatsLoggerConfig",
    "TimerConfig",
    "TinkerConfig",
    "TrainEngineConfig",
    "WorkflowConfig",
    "from_dict",
    "iter_fields",
    "load_config",
    "param",
    "parse_overrides",
    "read_yaml",
    "save_config",
    "to_dict",
]
