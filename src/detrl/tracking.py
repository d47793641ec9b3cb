"""Per-step metrics to W&B (offline by default) and to <run_dir>/metrics.jsonl, with the same keys (rank 0 only)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

from detrl.config import ConfigError, LoggerConfig

NUMERICS_FILE = "numerics.json"  # the run's numerics contract (detrl.models.preflight), written before step 1
# the files of a run dir that its W&B run carries (the offline run's files/, uploaded by `wandb sync`)
RUN_FILES = ("metrics.jsonl", "drift.jsonl", "config.yaml", NUMERICS_FILE)


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        cfg: LoggerConfig,
        run_name: str,
        group: str,
        config: dict[str, Any],
        tags: list[str] | None = None,
        job_type: str | None = None,
        run_id: str | None = None,
        resume_step: int | None = None,
    ):
        from detrl.distributed import is_main

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.wandb_run, self._file = None, None
        if not is_main():  # under torchrun only rank 0 logs (every rank has the same, gathered, metrics)
            return
        self._file = self.path.open("a", buffering=1)
        if cfg.backend == "wandb":
            import wandb

            mode = cfg.mode or os.environ.get("WANDB_MODE") or "offline"
            # a resumed run continues the same W&B run, rewound to its checkpoint's step (W&B's resume_from),
            # as metrics.jsonl is truncated to it: the steps the killed run logged after its last checkpoint
            # are logged again by this run and must replace, not follow, the old ones
            where = (
                dict(resume_from=f"{run_id}?_step={resume_step}")
                if resume_step is not None
                else dict(id=run_id, resume="allow" if run_id else None)
            )
            init = dict(
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group or group,
                name=run_name,
                tags=list(cfg.tags) + list(tags or []),
                config=config,
                dir=str(run_dir),
                mode=mode,
                job_type=job_type or run_name,
                settings=wandb.Settings(silent=True, console="off"),
            )
            try:
                self.wandb_run = wandb.init(**init, **where)
            except wandb.errors.UsageError as e:  # e.g. online without credentials: one line, what to do
                self._file.close()
                why = str(e).splitlines()[0].rstrip(".")
                login = "" if "wandb login" in why else "; run `wandb login`"
                raise ConfigError(
                    f"logger.mode={mode}: {why}{login} (or set WANDB_API_KEY), or log offline: "
                    "logger.mode=offline or WANDB_MODE=offline"
                ) from None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            return
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
        if self.wandb_run is not None:
            # the run's files travel with it (drift.jsonl: distances can be computed from W&B). Saved now that
            # they exist: wandb's save of a file that does not exist yet records nothing
            # (its "Symlinked ... call wandb.save again" warning, one per file, says nothing at the end of a run)
            with contextlib.redirect_stderr(io.StringIO()):
                for name in RUN_FILES:
                    if (self.run_dir / name).is_file():
                        self.wandb_run.save(
                            str(self.run_dir / name), base_path=str(self.run_dir), policy="now"
                        )
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
