from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from detrl.config import TrainConfig, register_configs, to_typed

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
# a short warm start (cached once per session) so that rewards, advantages and updates are non-zero
TINY = [
    "steps=3",
    "train_batch_size=8",
    "rollout.n=4",
    "warmstart.steps=40",
    "logger=none",
    "checkpoint.save_final=false",
]

register_configs()


@pytest.fixture(autouse=True, scope="session")
def _cache(tmp_path_factory):
    import os

    os.environ.setdefault("DETRL_CACHE_DIR", str(tmp_path_factory.mktemp("detrl-cache")))
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"


def make_cfg(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_typed(compose("train", overrides=list(overrides)))


def read_metrics(run_dir: Path) -> list[dict]:
    from detrl.analysis.load import load_metrics

    return load_metrics(run_dir)


def run_tiny(tmp_path: Path, *overrides: str) -> list[dict]:
    from detrl.trainer import train

    train(make_cfg(*TINY, *overrides), tmp_path)
    return read_metrics(tmp_path)
