"""From Hydra's composed DictConfig to the typed tree: the schemas' registration, the unknown-key check and
the one conversion at the entrypoint."""

from __future__ import annotations

import dataclasses
import difflib

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from detrl.config.base import ConfigError
from detrl.config.cross import validate
from detrl.config.run import ProbeConfig, TrainConfig


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    ConfigStore.instance().store(name="probe_schema", node=ProbeConfig)


def check_keys(node: DictConfig, where: str = "") -> None:
    """Refuse a key the schema lacks: `+model.hidden_sizee=256` (Hydra's hint for a typo) adds it past the
    struct check, and to_object would drop it without a word."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items_ex(resolve=False):
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {where}{near[0]}? " if near else ""
            raise ConfigError(
                f"unknown key {where}{key}: {hint}{where.rstrip('.') or 'the config'} has {names}"
            )
        if isinstance(value, DictConfig):
            check_keys(value, f"{where}{key}.")


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Convert the composed DictConfig into the dataclass tree, once, at the entrypoint."""
    check_keys(cfg)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    validate(typed)
    return typed
