"""What `train.py` runs inside Hydra: validate, train, report; bad input gets one line, not a traceback."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
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


class ReportCommand(Callback):
    """Hydra callback (conf/train.yaml): a multirun ends by printing the command that renders its report."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        print(f"sweep done; its report: python -m detrl.report {config.hydra.sweep.dir}")


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


def building_line(cfg, run_dir: Path) -> str:
    """What happens before step 1 (imports, the policy, the preflight, the engine: 10-20 s on a CPU), said at once."""
    m = cfg.model
    policy = (
        f"{m.path}"
        if m.path
        else f"the warm start (cached; else a {cfg.warmstart.steps}-step SFT, once)"
        if m.init == "warmstart"
        else f"{m.init} init"
    )
    return (
        f"detrl: building {m.name} from {policy}, the numerics preflight and the {cfg.rollout.backend} engine, "
        f"then {cfg.steps} step{'s' * (cfg.steps != 1)}; run dir {run_dir}"
    )


def reward_line(rows: list[dict], run_dir: Path | str, window: int = 5) -> str:
    """The run's last line, from the steps its metrics.jsonl holds (a run resumed into a new dir holds only
    its own): mean reward of the first and last `window` steps, never overlapping (fewer when under 2 windows).

    >>> reward_line([{"step": s, "critic/score/mean": s / 10} for s in (1, 2, 3)], "d")
    'reward: first 0.100 -> last 0.300 over 3 steps (1-3; means of 1 step); run dir d'
    """
    r = [row["critic/score/mean"] for row in rows]
    if not r:
        return f"reward: no steps logged; run dir {run_dir}"
    w, span = min(window, len(r) // 2), f"{rows[0]['step']}-{rows[-1]['step']}"
    if not w:
        return f"reward: {r[0]:.3f} over 1 step ({rows[0]['step']}); run dir {run_dir}"
    return (
        f"reward: first {sum(r[:w]) / w:.3f} -> last {sum(r[-w:]) / w:.3f} over {len(r)} steps "
        f"({span}; means of {w} step{'s' * (w > 1)}); run dir {run_dir}"
    )


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
    if os.environ.get("RANK", "0") == "0":
        print(building_line(typed, run_dir), flush=True)
    from detrl import distributed
    from detrl.analysis.load import load_metrics
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
        print(reward_line(load_metrics(run_dir), run_dir))
    return summary
