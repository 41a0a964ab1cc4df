"""One typed config tree. Import sections and the loader from here.

``loader.py`` holds the machinery (param, load_config, ConfigError); each other module holds the
sections of one part of the system. A new section goes in the module of the part that owns it
and is re-exported here.
"""

from areal.api.config.base import (
    BaseExperimentConfig,
    GenerationHyperparameters,
    MicroBatchSpec,
    OptimizerConfig,
    RecoverConfig,
    StatsLoggerConfig,
    TimerConfig,
)
from areal.api.config.data import DatasetConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.experiments import GRPOConfig, RWConfig, SFTConfig
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

__all__ = [
    "BaseExperimentConfig",
    "ConfigError",
    "DatasetConfig",
    "GRPOConfig",
    "GenerationHyperparameters",
    "MicroBatchSpec",
    "OptimizerConfig",
    "RWConfig",
    "RecoverConfig",
    "SFTConfig",
    "StatsLoggerConfig",
    "TimerConfig",
    "TrainEngineConfig",
    "from_dict",
    "iter_fields",
    "load_config",
    "param",
    "parse_overrides",
    "read_yaml",
    "save_config",
    "to_dict",
]
