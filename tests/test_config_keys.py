"""A key the schema lacks fails in one line, also when added with `+` (Hydra's own hint for a typo)."""

import pytest
from hydra import compose, initialize_config_dir

from detrl.config import ConfigError, check_keys
from tests.conftest import CONF, ROOT, make_cfg


@pytest.mark.parametrize(
    "override, named, hint",
    [
        ("+model.hidden_sizee=256", "model.hidden_sizee", "did you mean model.hidden_size?"),
        ("+algo.filter_groups.metricc=acc", "algo.filter_groups.metricc", "algo.filter_groups.metric?"),
        ("+stepz=3", "stepz", "did you mean steps?"),
    ],
)
def test_an_added_unknown_key_is_refused_naming_it_and_the_valid_keys(override, named, hint):
    with pytest.raises(ConfigError) as e:
        make_cfg(override)
    msg = str(e.value)
    assert "\n" not in msg and f"unknown key {named}:" in msg and hint in msg, msg


def test_an_added_known_key_and_every_preset_pass():
    assert make_cfg("++model.hidden_size=256").model.hidden_size == 256  # `++` on a key the schema has
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for group in ("experiment", "ablation"):
            for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
                check_keys(compose("train", overrides=[f"{group}={path.stem}"]))
