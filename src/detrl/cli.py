"""What `train.py` runs inside Hydra: validate, train, report; bad input gets one line, not a traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from detrl.config import ConfigError, to_typed


def wandb_group(multirun: bool, sweep_dir: str, experiment: str | None) -> str:
    """The W&B group: the sweep's name for a multirun, else the experiment's, else `single`.

    >>> wandb_group(True, "outputs/sweeps/smoke_2026-11-29_10-00-00", "smoke")
    'smoke_2026-11-29_10-00-00'
    """
    if multirun:
        return Path(sweep_dir).name
    return experiment or "single"


def resume_hint(signame: str, run_dir: Path, overrides: list[str]) -> str:
    """One line: what stopped the run, its last checkpoint, and the command that continues it.

    >>> resume_hint("SIGTERM", Path("/r"), ["steps=9", "resume=auto"])
    'stopped by SIGTERM (no checkpoint yet: resume=auto starts over); resume with: python train.py steps=9 resume=auto run_dir=/r'
    """
    from detrl.checkpoint import latest

    ckpt = latest(run_dir)
    where = f"last checkpoint {ckpt.name}" if ckpt else "no checkpoint yet: resume=auto starts over"
    keep = [o for o in overrides if not o.startswith(("resume=", "run_dir=", "hydra."))]
    return f"stopped by {signame} ({where}); resume with: python train.py {' '.join([*keep, 'resume=auto', f'run_dir={run_dir}'])}"


def _remove_if_fresh(run_dir: Path) -> None:
    """Remove a run dir that holds nothing but Hydra's own files (a run that never started)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def main_task(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        typed = to_typed(cfg)
    except (ConfigError, ValueError) as e:  # OmegaConf validation errors are ValueErrors too
        _remove_if_fresh(run_dir)
        print(f"detrl: config error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    if typed.run_dir and Path(typed.run_dir).resolve() != run_dir.resolve():
        _remove_if_fresh(run_dir)  # Hydra's own dir is not used
        run_dir = Path(typed.run_dir)
    from detrl import distributed
    from detrl.trainer import train  # heavy imports after validation

    if not typed.run_dir and distributed.requested_world_size() > 1:  # torchrun: every rank uses rank 0's dir
        ours, run_dir = (
            run_dir,
            distributed.same_run_dir(run_dir),
        )  # (Hydra names one by each process's start)
        if ours != run_dir:
            _remove_if_fresh(ours)

    group = wandb_group(hc.mode == RunMode.MULTIRUN, hc.sweep.dir, typed.experiment)
    from detrl.guards import Interrupted, stop_on_signals
    from detrl.rollout.sglang import ServerError

    try:
        with (
            stop_on_signals()
        ):  # SIGINT / SIGTERM: a clean stop (checkpoint if the step completed, W&B finished)
            summary = train(typed, run_dir, group=group)
    except Interrupted as e:
        print(f"detrl: {resume_hint(e.name, run_dir, list(hc.overrides.task))}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except ConfigError as e:  # e.g. a refused resume: one line, and what was logged stays as it was
        print(f"detrl: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    except ServerError as e:  # a rollout server died: named in one line; logged steps and checkpoints stay
        print(f"detrl: {str(e).splitlines()[0]} (run dir {run_dir})", file=sys.stderr)
        sys.exit(1)
    main = distributed.is_main()
    distributed.close()  # torchrun: leave the process group
    if summary and main:
        print(
            f"reward: first {summary['reward/first']:.3f} -> last {summary['reward/last']:.3f} "
            f"over {summary['steps']} steps; run dir {run_dir}"
        )
    return summary
