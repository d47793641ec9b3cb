"""The experiments/ recipes compose with Hydra and validate, in both determinism variants."""

import pytest
from hydra import compose, initialize_config_dir

from detrl.config import to_typed
from tests.conftest import CONF

RECIPES = {
    "qwen3_8b_gsm8k_grpo": ("qwen3", 4096, "gsm8k", "grpo", 5),
    "qwen3_30b_a3b_gsm8k_grpo": ("qwen3_moe", 2048, "gsm8k", "grpo", 5),
    "dapo_math_qwen3_8b": ("qwen3", 4096, "math", "dapo", 16),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("det", ["on", "off"])
def test_recipe_composes(recipe, det):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        raw = compose(
            "train",
            overrides=[
                f"experiment={recipe}",
                f"determinism={det}",
                "model.path=/ckpt",
                "data.path=/data/train.parquet",
                "data.eval_path=/data/test.parquet",
            ],
        )
        sweep = raw.hydra.sweeper.params if "hydra" in raw else None  # compose() drops the hydra node
    cfg = to_typed(raw)
    arch, hidden, data, algo, n = RECIPES[recipe]
    assert (cfg.model.name, cfg.model.hidden_size, cfg.data.name, cfg.algo.name, cfg.rollout.n) == (
        arch,
        hidden,
        data,
        algo,
        n,
    )
    assert cfg.determinism.name == det and cfg.experiment == recipe and cfg.eval.every > 0
    assert sweep is None or sweep["determinism"] == "on,off"
    if algo == "dapo":
        assert (cfg.algo.clip_ratio_high, cfg.algo.overlong.buffer_len, cfg.rollout.max_new_tokens) == (
            0.28,
            4096,
            20480,
        )
    else:
        assert (cfg.algo.kl_loss_coef, cfg.algo.kl_loss_type, cfg.algo.clip_ratio_high) == (
            0.001,
            "low_var_kl",
            0.2,
        )
