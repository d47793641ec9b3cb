"""What `train.py` runs inside Hydra: validate, train, report; bad input gets one line, not a traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from detrl.config import ConfigError, to_typed


def _hydra_dirs() -> tuple[Path, str]:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    group = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else "single"
    return run_dir, group


def _remove_if_fresh(run_dir: Path) -> None:
    """Remove a run dir that holds nothing but Hydra's own files (a run that never started)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def main_task(cfg: DictConfig) -> dict:
    run_dir, group = _hydra_dirs()
    try:
        typed = to_typed(cfg)
    except (ConfigError, ValueError) as e:  # OmegaConf validation errors are ValueErrors too
        _remove_if_fresh(run_dir)
        print(f"detrl: config error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    if typed.run_dir:
        run_dir = Path(typed.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    from detrl.trainer import train  # heavy imports after validation

    summary = train(typed, run_dir, group=typed.experiment or group)
    if summary:
        print(f"reward: first {summary['reward/first']:.3f} -> last {summary['reward/last']:.3f} "
              f"over {summary['steps']} steps; run dir {run_dir}")
    return summary
