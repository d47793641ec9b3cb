"""Typed config schemas, registered in Hydra's ConfigStore.

`conf/train.yaml` starts from `train_schema`, so every group file is validated against these
dataclasses at compose time: a typo'd key or a value of the wrong type fails before anything runs.
Each group's dataclass checks its own rules in `validate()`; the rules that read several groups live in
`detrl.config.cross`, whose `validate` runs them all, once, in `to_typed` (`detrl.config.load`). Every
refusal raises `ConfigError` with one line naming the key, the value and what is valid.
"""

from detrl.config.algo import (
    ALGO_NAMES,
    AlgoConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    OverlongConfig,
    PolicyLossArgs,
    RolloutCorrParams,
    _validate_algo_variants,
)
from detrl.config.base import ConfigError, check, choice
from detrl.config.cross import validate
from detrl.config.data import DataConfig, EvalConfig
from detrl.config.determinism import DeterminismConfig
from detrl.config.load import check_keys, register_configs, to_typed
from detrl.config.model import MODEL_INITS, ModelConfig, WarmstartConfig
from detrl.config.rollout import ROLLOUT_BACKENDS, PartialRolloutConfig, RolloutConfig, SGLangConfig
from detrl.config.run import (
    LOGGER_BACKENDS,
    CheckpointConfig,
    LoggerConfig,
    OptimConfig,
    ProbeConfig,
    TrainConfig,
)

# each group of the tree (a TrainConfig field) -> its schema; every one has its own `validate()`
GROUPS = {
    "model": ModelConfig,
    "algo": AlgoConfig,
    "determinism": DeterminismConfig,
    "rollout": RolloutConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "logger": LoggerConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "warmstart": WarmstartConfig,
}

__all__ = [
    "ALGO_NAMES",
    "GROUPS",
    "LOGGER_BACKENDS",
    "MODEL_INITS",
    "ROLLOUT_BACKENDS",
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DeterminismConfig",
    "EvalConfig",
    "FilterGroupsConfig",
    "KLCtrlConfig",
    "LoggerConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongConfig",
    "PartialRolloutConfig",
    "PolicyLossArgs",
    "ProbeConfig",
    "RolloutConfig",
    "RolloutCorrParams",
    "SGLangConfig",
    "TrainConfig",
    "WarmstartConfig",
    "_validate_algo_variants",
    "check",
    "check_keys",
    "choice",
    "register_configs",
    "to_typed",
    "validate",
]
