import itertools
import subprocess
import sys

import pytest

from detrl.config import ConfigError
from tests.conftest import ROOT, make_cfg

GROUPS = {
    "model": ["qwen3", "qwen3_moe"],
    "algo": ["grpo", "dapo"],
    "determinism": ["on", "off"],
    "rollout": ["embedded"],
    "data": ["arithmetic"],
    "logger": ["wandb", "none"],
}


@pytest.mark.parametrize("choice", list(itertools.product(*GROUPS.values())))
def test_every_group_combination_composes(choice):
    cfg = make_cfg(*(f"{g}={c}" for g, c in zip(GROUPS, choice)))
    assert cfg.model.name == choice[0] and cfg.algo.name == choice[1] and cfg.determinism.name == choice[2]
    from detrl.determinism import preset

    assert {s: getattr(cfg.determinism, s) for s in preset("on")} == preset(choice[2])
    assert cfg.logger.backend == choice[5]


def test_algo_defaults_follow_the_field():
    grpo, dapo = make_cfg("algo=grpo").algo, make_cfg("algo=dapo").algo
    assert (grpo.clip_ratio_low, grpo.clip_ratio_high, grpo.loss_agg_mode) == (
        0.2,
        0.2,
        "seq-mean-token-mean",
    )
    assert grpo.use_kl_loss and grpo.kl_loss_coef == 0.001 and grpo.kl_loss_type == "low_var_kl"
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high, dapo.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert dapo.loss_agg_mode == "token-mean" and not dapo.use_kl_loss
    assert dapo.filter_groups.enabled and dapo.overlong.enabled


def test_overrides_reach_the_typed_config():
    cfg = make_cfg("model=qwen3_moe", "model.hidden_size=64", "model.num_experts=8", "seed=7", "repeat=2")
    assert (cfg.model.hidden_size, cfg.model.num_experts, cfg.seed, cfg.repeat) == (64, 8, 7, 2)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algo.clip_ratio_c=0.5", "algo.clip_ratio_c=0.5"),
        ("algo.overlong.buffer_len=-1", "algo.overlong.buffer_len=-1"),
        ("algo.loss_agg_mode=foo", "algo.loss_agg_mode='foo'"),
        ("algo.kl_loss_type=k9", "algo.kl_loss_type='k9'"),
        ("rollout.top_p=0", "rollout.top_p=0"),
        ("rollout.partial.stale_tokens=drop", "rollout.partial.stale_tokens='drop'"),
        ("grad_clip=-1", "grad_clip=-1"),
        ("algo.ppo_mini_batch_size=5", "algo.ppo_mini_batch_size=5"),
        ("algo.ppo_epochs=0", "algo.ppo_epochs=0"),
        ("algo.filter_groups.metric=len", "algo.filter_groups.metric='len'"),
        ("optim.lr_scheduler_type=linear", "optim.lr_scheduler_type='linear'"),
    ],
)
def test_invalid_settings_fail_with_one_line_naming_the_value(override, needle):
    with pytest.raises(ConfigError) as e:
        make_cfg(override)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model=qwen4", "model/qwen4"),
        ("steps=abc", "'abc'"),
        ("algo.clip_ratio_c=0.5", "algo.clip_ratio_c=0.5"),
    ],
)
def test_cli_rejects_bad_input_without_leaving_a_run_dir(tmp_path, override, needle):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", override, f"hydra.run.dir={run_dir}", "logger=none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_validating_a_config_does_not_load_transformers_model_code():
    """A config is checked (and a bad value refused in one line) before transformers' model code is imported: it
    was ~5 s of every refusal's 8 s on 2 cores. Building the model still finds `detrl.models.build_model`."""
    code = (
        "import sys\n"
        "from tests.conftest import make_cfg\n"
        "from detrl.config import ConfigError\n"
        "make_cfg('model=qwen3_moe', 'algo=dapo')\n"
        "try:\n    make_cfg('algo.clip_ratio_c=0.5')\nexcept ConfigError as e:\n    print('refused', e)\n"
        "print(any(m.startswith('transformers') for m in sys.modules))\n"
        "from detrl.models import build_model\n"
        "print(type(build_model(make_cfg().model, seed=0)).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused algo.clip_ratio_c=0.5") and lines[1:] == [
        "False",
        "Qwen3ForCausalLM",
    ], lines


def test_dapo_differs_from_grpo_only_through_its_yaml():
    from dataclasses import asdict

    from omegaconf import OmegaConf

    dapo_yaml = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "algo" / "dapo.yaml"))

    def flat(d, prefix="algo"):
        for k, v in d.items():
            yield from flat(v, f"{prefix}.{k}") if isinstance(v, dict) else [f"{prefix}.{k}={v}"]

    as_grpo = make_cfg("algo=grpo", *flat(dapo_yaml))
    assert asdict(as_grpo.algo) == asdict(make_cfg("algo=dapo").algo)
