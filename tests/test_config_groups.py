"""Each group's dataclass validates itself; cross-group rules live in detrl.config.cross; each list of
choices in an error is the registry's that the code runs."""

import copy
import dataclasses
import typing

import pytest

from detrl.config import GROUPS, ConfigError, TrainConfig, validate
from detrl.config import cross as cross_rules
from tests.conftest import make_cfg


@pytest.fixture(scope="module")
def base() -> TrainConfig:
    return make_cfg("logger=none")


def _set(cfg, key: str, value):
    *path, last = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    setattr(cfg, last, value)


def _with(base: TrainConfig, **settings) -> TrainConfig:
    cfg = copy.deepcopy(base)
    for key, value in settings.items():
        _set(cfg, key.replace("__", "."), value)
    return cfg


def test_every_group_of_the_tree_has_its_own_validate():
    hints = typing.get_type_hints(TrainConfig)
    assert GROUPS == {name: t for name, t in hints.items() if dataclasses.is_dataclass(t)}
    for schema in GROUPS.values():
        assert "validate" in vars(schema), f"{schema.__name__} has no validate() of its own"
        schema().validate()  # its defaults are valid


# one bad value per group: (group, key, value); its own validate refuses it, naming the key, in one line
BAD = [
    ("model", "model.dtype", "float8"),
    ("algo", "algo.clip_ratio_c", 0.5),
    ("determinism", "determinism.kernels", "fast"),
    ("rollout", "rollout.partial.off_cut", "never"),
    ("data", "data.gsm8k_method", "loose"),
    ("eval", "eval.batch_prompts", 0),
    ("logger", "logger.backend", "tensorboard"),
    ("optim", "optim.min_lr_ratio", 2.0),
    ("checkpoint", "checkpoint.keep_last", 0),
    ("warmstart", "warmstart.batch_size", 0),
]


def test_the_table_covers_every_group():
    assert {g for g, _, _ in BAD} == set(GROUPS)


@pytest.mark.parametrize("group, key, value", BAD, ids=[k for _, k, _ in BAD])
def test_a_bad_value_is_refused_by_its_group_in_one_line_naming_the_key(base, group, key, value):
    cfg = _with(base, **{key.replace(".", "__"): value})
    for name in GROUPS:  # the other groups accept it: the rule is its group's own
        if name != group:
            getattr(cfg, name).validate()
    with pytest.raises(ConfigError) as own:
        getattr(cfg, group).validate()
    with pytest.raises(ConfigError) as whole:
        validate(cfg)
    message = str(own.value)
    assert message == str(whole.value) and "\n" not in message
    assert message.startswith(f"{key}={value!r} is not valid")


# cross-group rules: every group alone accepts the config, detrl.config.cross refuses it
CROSS = [
    ({"algo__routing_replay": True}, "check_algo_rollout", "algo.routing_replay=True"),
    (
        {"algo__overlong__enabled": True, "algo__overlong__buffer_len": 9},
        "check_algo_rollout",
        "buffer_len=9",
    ),
    ({"algo__ppo_mini_batch_size": 5}, "check_batches", "algo.ppo_mini_batch_size=5"),
    ({"algo__old_logprobs": "current"}, "check_batches", "with algo.old_logprobs=current"),
    (
        {"rollout__partial__enabled": True, "determinism__cut": "async"},
        "check_determinism",
        "determinism.cut='async'",
    ),
    ({"data__name": "gsm8k", "data__path": "/x"}, "check_data", "model.init='warmstart'"),
]


@pytest.mark.parametrize("settings, rule, needle", CROSS, ids=[r for _, r, _ in CROSS])
def test_cross_group_rules_are_refused_only_by_the_cross_module(base, settings, rule, needle):
    cfg = _with(base, **settings)
    for name in GROUPS:
        getattr(cfg, name).validate()
    with pytest.raises(ConfigError, match=needle) as e:
        getattr(cross_rules, rule)(cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=needle):
        validate(cfg)


def _registries():
    from detrl.actor.old_pass import OLD_LOGPROBS
    from detrl.algos.core import LR_SCHEDULERS, STALE_TOKENS
    from detrl.algos.rollout_correction import MODES
    from detrl.collect import FILTER_METRICS
    from detrl.config.model import ARCHITECTURES
    from detrl.data.registry import TASK_NAMES
    from detrl.determinism import SOURCES
    from detrl.device import DTYPES
    from detrl.rollout.batching import SCHEDULERS

    return {
        "model.name": list(dict.fromkeys(ARCHITECTURES.values())),
        "model.dtype": ["auto", *DTYPES],
        "algo.old_logprobs": list(OLD_LOGPROBS),
        "algo.rollout_correction": list(MODES),
        "algo.filter_groups.metric": list(FILTER_METRICS),
        "rollout.scheduler": list(SCHEDULERS),
        "rollout.partial.stale_tokens": list(STALE_TOKENS),
        "optim.lr_scheduler_type": list(LR_SCHEDULERS),
        "data.name": list(TASK_NAMES),
        "determinism.kernels": list(SOURCES["kernels"]),
    }


@pytest.mark.parametrize("key", list(_registries()))
def test_the_choices_in_an_error_are_the_registrys(base, key):
    with pytest.raises(ConfigError) as e:
        validate(_with(base, **{key.replace(".", "__"): "bogus"}))
    assert str(e.value) == f"{key}='bogus' is not valid; choose one of {_registries()[key]}"
