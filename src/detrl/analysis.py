"""Load a sweep and compare its runs step by step through their fingerprints.

A sweep dir holds one run dir per job (Hydra multirun). A run's cell is its overrides minus the
replicate index (`repeat=`): runs of one cell differ only by repeat, so a deterministic cell has
exactly one trajectory. A run without `summary.json` (killed, or still running) is `incomplete`;
its logged steps still load, a half-written last line is dropped.

    >>> sweep = load_sweep("outputs/sweeps/smoke_...")          # doctest: +SKIP
    >>> verdicts(sweep)                                          # doctest: +SKIP
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

# in the order a step produces them: the first one to differ says where nondeterminism entered
FP_ORDER = ("fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order", "fp/params")
FP_SOURCE = {"fp/rollout_tokens": "rollout", "fp/rollout_logprobs": "rollout", "fp/batch_order": "rollout order",
             "fp/params": "trainer"}
_NOT_CELL = ("repeat", "experiment", "logger", "hydra", "run_dir", "resume", "checkpoint")


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl; a half-written last line (a killed run) is dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def first_divergence(a: list[dict], b: list[dict]) -> tuple[int, str] | None:
    """(step, fingerprint key) of the first difference between two runs over their common steps.

    >>> row = {"step": 1, **dict.fromkeys(FP_ORDER, "x")}
    >>> first_divergence([row], [row]) is None, first_divergence([row], [{**row, "fp/params": "y"}])
    (True, (1, 'fp/params'))
    """
    for ra, rb in zip(a, b):
        for key in FP_ORDER:
            if ra.get(key) != rb.get(key):
                return ra["step"], key
    return None


def trajectory(rows: list[dict], upto: int | None = None) -> tuple:
    return tuple(tuple(r.get(k) for k in FP_ORDER) for r in rows[:upto])


def distinct_trajectories(runs: list[list[dict]]) -> int:
    common = min((len(r) for r in runs), default=0)
    return len({trajectory(r, common) for r in runs})


@dataclass
class Sweep:
    path: Path
    runs: pd.DataFrame  # one row per run: run, path, cell, repeat, status, steps_logged, steps_expected, ...
    metrics: pd.DataFrame  # one row per (run, step), every logged key as a column
    rows: dict[str, list[dict]]  # run -> its metrics rows, for fingerprint comparisons


_SHORT = {"rollout.partial.enabled=false": "partial=off", "rollout.partial.enabled=true": "partial=on"}


def _cell(overrides: list[str]) -> str:
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0].split("/")[0] not in _NOT_CELL]
    return ",".join(sorted(_SHORT.get(o.lower(), o) for o in keep)) or "default"


def _load_run(run_dir: Path) -> tuple[dict, list[dict]]:
    over_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(over_file.read_text()) or [] if over_file.is_file() else []
    cfg_file = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
    rows = load_metrics(run_dir)
    done = (run_dir / "summary.json").is_file()
    repeat = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("repeat=")), cfg.get("repeat", 0))
    info = {
        "run": run_dir.name, "path": str(run_dir), "cell": _cell(overrides), "repeat": repeat,
        "status": "complete" if done and len(rows) == cfg.get("steps", len(rows)) else "incomplete",
        "steps_logged": len(rows), "steps_expected": cfg.get("steps"),
        "model": (cfg.get("model") or {}).get("name"), "algo": (cfg.get("algo") or {}).get("name"),
        "determinism": (cfg.get("determinism") or {}).get("name"),
        "partial": ((cfg.get("rollout") or {}).get("partial") or {}).get("enabled"),
    }
    return info, rows


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """Every run dir under `sweep_dir` (a dir holding metrics.jsonl or .hydra/), complete or not."""
    sweep_dir = Path(sweep_dir)
    run_dirs = sorted({p.parent for p in sweep_dir.glob("*/metrics.jsonl")} | {p.parent for p in sweep_dir.glob("*/.hydra")})
    if not run_dirs:
        raise FileNotFoundError(f"no runs under {sweep_dir} (expected <run>/metrics.jsonl or <run>/.hydra)")
    infos, all_rows, flat = [], {}, []
    for d in run_dirs:
        info, rows = _load_run(d)
        infos.append(info)
        all_rows[info["run"]] = rows
        flat += [{"run": info["run"], "cell": info["cell"], "repeat": info["repeat"], **r} for r in rows]
    return Sweep(sweep_dir, pd.DataFrame(infos), pd.DataFrame(flat), all_rows)


def verdicts(sweep: Sweep) -> pd.DataFrame:
    """Per cell: complete repeats, distinct trajectories, first divergence (step, fingerprint, source)."""
    out = []
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        complete = runs[runs.status == "complete"].sort_values("repeat")
        rows = [sweep.rows[r] for r in complete.run]
        divs = [d for d in (first_divergence(rows[0], r) for r in rows[1:]) if d] if rows else []
        first = min(divs) if divs else None
        m = sweep.metrics[sweep.metrics.run.isin(complete.run)]
        n = distinct_trajectories(rows) if rows else 0
        verdict = ("incomplete" if len(rows) < 2 else "bitwise identical" if n == 1
                   else f"diverges at step {first[0]} in {FP_SOURCE[first[1]]}")
        out.append({
            "cell": cell, "determinism": runs.determinism.iloc[0], "repeats": len(rows),
            "incomplete": int((runs.status != "complete").sum()), "distinct_trajectories": n,
            "first_divergence_step": first[0] if first else None, "first_divergence_fp": first[1] if first else None,
            "reward_last": m.groupby("run")["critic/score/mean"].last().mean() if len(m) else None,
            "step_time_s": m["timing_s/step"].median() if len(m) else None,
            "mismatch_max": m["mismatch/train_rollout_logprob_abs_diff_max"].max() if len(m) else None,
            "verdict": verdict,
        })
    return pd.DataFrame(out)


def divergence_matrix(sweep: Sweep) -> pd.DataFrame:
    """cells x steps: how many distinct fingerprint histories the complete repeats have up to that step."""
    table = {}
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        rows = [sweep.rows[r] for r in runs[runs.status == "complete"].run]
        if not rows:
            continue
        common = min(len(r) for r in rows)
        table[cell] = {t + 1: len({trajectory(r, t + 1) for r in rows}) for t in range(common)}
    return pd.DataFrame(table).T.sort_index()


def spread(sweep: Sweep, metric: str) -> pd.DataFrame:
    """Per cell and step: mean / min / max / std of `metric` across the cell's complete repeats."""
    complete = sweep.runs[sweep.runs.status == "complete"].run
    m = sweep.metrics[sweep.metrics.run.isin(complete)]
    return m.groupby(["cell", "step"])[metric].agg(["mean", "min", "max", "std"]).reset_index()
