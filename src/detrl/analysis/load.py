"""Read a sweep into pandas: from its local run dirs, or from W&B (its runs' history) when reachable.

A sweep dir holds one run dir per job (Hydra multirun). A run's cell is its overrides minus the
replicate index (`repeat=`): runs of one cell differ only by repeat, so a deterministic cell has
exactly one trajectory. A run without `summary.json` (killed, or still running) is `incomplete`;
its logged steps still load, a half-written last line is dropped.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from detrl.determinism import label as det_label
from detrl.fingerprint import DRIFT_FILE
from detrl.tracking import NUMERICS_FILE

_NOT_CELL = ("repeat", "experiment", "logger", "hydra", "run_dir", "resume", "checkpoint")
_SHORT = {
    "rollout.partial.enabled=false": "partial=off",
    "rollout.partial.enabled=true": "partial=on",
    "partial=false": "partial=off",
    "partial=true": "partial=on",
}


@dataclass
class Sweep:
    path: Path
    runs: pd.DataFrame  # one row per run: run, path, cell, repeat, status, steps_logged, steps_expected, ...
    metrics: pd.DataFrame  # one row per (run, step), every logged key as a column
    rows: dict[str, list[dict]]  # run -> its metrics rows, for fingerprint comparisons
    drift: dict[str, dict[int, dict]] = field(default_factory=dict)  # run -> step -> drift record (sketches)
    source: str = "local"  # "local" | "wandb"
    memo: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # tables derived once per loaded sweep


def _yaml(text: str):
    """yaml.safe_load with libyaml's parser where PyYAML has it (the same result; ~10x faster on a sweep's
    configs, which dominated loading a 108-run sweep)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl; a half-written last line (a killed run) is dropped."""
    return _read_jsonl(Path(run_dir) / "metrics.jsonl")


def load_drift(run_dir: str | Path) -> dict[int, dict]:
    """step -> {param_norm, param_sketch (array), logprob_sketch (array)} from drift.jsonl; a step logged
    twice (a resumed run redoes the steps after its checkpoint) keeps its last record."""
    out = {}
    for r in _read_jsonl(Path(run_dir) / DRIFT_FILE):
        out[int(r["step"])] = {
            "param_norm": r.get("param_norm"),
            "param_sketch": np.asarray(r["param_sketch"], dtype=np.float64),
            "logprob_sketch": np.asarray(r["logprob_sketch"], dtype=np.float64),
        }
    return out


def cell_of(overrides: list[str]) -> str:
    keep = [
        o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0].split("/")[0] not in _NOT_CELL
    ]
    return ",".join(sorted(_SHORT.get(o.lower(), o) for o in keep)) or "default"


def host_of(numerics: dict) -> str | None:
    """The machine a run's bits came from, as its numerics contract names it: the GPU, or the CPU model with its
    vector ISA and BLAS (None: not recorded, a run from before the contract held it)."""
    h = numerics.get("host")
    if h:
        return f"{h.get('cpu')} ({h.get('isa')}, {h.get('blas')})"
    device = numerics.get("device")
    return None if device is None or device.startswith("cpu") else device


def _numerics(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _info(
    run: str, path: str, overrides: list[str], cfg: dict, rows: list[dict], done: bool, numerics: dict
) -> dict:
    repeat = next(
        (int(o.split("=", 1)[1]) for o in overrides if o.startswith("repeat=")), cfg.get("repeat", 0)
    )
    return {
        "run": run,
        "path": path,
        "cell": cell_of(overrides),
        "repeat": repeat,
        "status": "complete" if done and len(rows) == cfg.get("steps", len(rows)) else "incomplete",
        "steps_logged": len(rows),
        "steps_expected": cfg.get("steps"),
        "model": (cfg.get("model") or {}).get("name"),
        "algo": (cfg.get("algo") or {}).get("name"),
        "determinism": det_label(cfg.get("determinism") or {}),
        "partial": ((cfg.get("rollout") or {}).get("partial") or {}).get("enabled"),
        "host": host_of(numerics),
    }


def _assemble(path: Path, runs: list[tuple[dict, list[dict], dict[int, dict]]], source: str) -> Sweep:
    infos, all_rows, drift, flat = [], {}, {}, []
    for info, rows, d in runs:
        infos.append(info)
        all_rows[info["run"]] = rows
        drift[info["run"]] = d
        flat += [{"run": info["run"], "cell": info["cell"], "repeat": info["repeat"], **r} for r in rows]
    return Sweep(path, pd.DataFrame(infos), pd.DataFrame(flat), all_rows, drift, source)


def load_local(sweep_dir: str | Path) -> Sweep:
    """Every run dir under `sweep_dir` (a dir holding metrics.jsonl or .hydra/), complete or not."""
    sweep_dir = Path(sweep_dir)
    run_dirs = sorted(
        {p.parent for p in sweep_dir.glob("*/metrics.jsonl")} | {p.parent for p in sweep_dir.glob("*/.hydra")}
    )
    if not run_dirs:
        raise FileNotFoundError(f"no runs under {sweep_dir} (expected <run>/metrics.jsonl or <run>/.hydra)")
    runs = []
    for d in run_dirs:
        over_file = d / ".hydra" / "overrides.yaml"
        overrides = (_yaml(over_file.read_text()) or []) if over_file.is_file() else []
        cfg_file = d / "config.yaml"
        cfg = (_yaml(cfg_file.read_text()) or {}) if cfg_file.is_file() else {}
        rows = load_metrics(d)
        runs.append(
            (
                _info(
                    d.name,
                    str(d),
                    overrides,
                    cfg,
                    rows,
                    (d / "summary.json").is_file(),
                    _numerics(d / NUMERICS_FILE),
                ),
                rows,
                load_drift(d),
            )
        )
    return _assemble(sweep_dir, runs, "local")


def load_wandb(path: str, api=None, drift_dir: str | Path | None = None) -> Sweep:
    """The runs of one W&B group, `path` = "entity/project/group" (or "project/group": the default entity).

    Uses the public API: `api.runs(entity/project, filters={"group": group})`, each run's `config`, `tags`
    (the cell: every tag but `repeat=`), `state` ("finished" = complete) and `scan_history()` (every
    logged row, not a sample, so fingerprints compare exactly). A run's `drift.jsonl` is read through
    `run.file(...)` when the run uploaded it.
    """
    if api is None:
        import wandb

        api = wandb.Api(timeout=30)
    *project, group = path.strip("/").split("/")
    if not project:
        raise ValueError(f"wandb path {path!r}: expected entity/project/group or project/group")
    drift_root = Path(drift_dir or tempfile.mkdtemp(prefix="detrl-wandb-"))
    runs = []
    for run in api.runs("/".join(project), filters={"group": group}):
        cfg = dict(run.config)
        tags = [t for t in (run.tags or []) if "=" in t]
        overrides = [t for t in tags if not t.startswith("repeat=")] + [f"repeat={cfg.get('repeat', 0)}"]
        rows = []
        for r in run.scan_history():
            step = r.get("_step")
            rows.append({"step": int(step), **{k: v for k, v in r.items() if not k.startswith("_")}})
        rows.sort(key=lambda r: r["step"])
        here = drift_root / run.id
        drift = load_drift(here) if _download(run, DRIFT_FILE, here) else {}  # else: without distances
        numerics = _numerics(here / NUMERICS_FILE) if _download(run, NUMERICS_FILE, here) else {}
        info = _info(
            run.name,
            f"wandb:{'/'.join(project)}/{run.id}",
            overrides,
            cfg,
            rows,
            run.state == "finished",
            numerics,
        )
        runs.append((info, rows, drift))
    if not runs:
        raise FileNotFoundError(f"no W&B runs in group {group!r} of {'/'.join(project)}")
    return _assemble(Path(path), runs, "wandb")


def _download(run, name: str, root: Path) -> bool:
    """One of a W&B run's uploaded files into root; False where the run did not upload it (or W&B fails)."""
    try:
        run.file(name).download(root=str(root), replace=True)
        return True
    except Exception:  # noqa: BLE001 - not uploaded: the run still loads without it
        return False


def load_sweep(sweep_dir: str | Path | None = None, wandb_path: str | None = None, api=None) -> Sweep:
    """A sweep from W&B when `wandb_path` is given and W&B answers (a cluster sweep, read from a laptop), else
    from the local run dirs under `sweep_dir` (offline, no API key, no such group, any API error: a warning
    says why). With no `sweep_dir` the W&B answer is the only source.

    >>> sweep = load_sweep("outputs/sweeps/smoke_...")                          # doctest: +SKIP
    >>> sweep = load_sweep("outputs/sweeps/x", wandb_path="me/detrl/x")         # doctest: +SKIP
    """
    if wandb_path:
        try:
            return load_wandb(wandb_path, api=api)
        except Exception as e:  # noqa: BLE001 - any failure of the remote source falls back to the files
            if sweep_dir is None:
                raise
            warnings.warn(
                f"W&B {wandb_path}: {type(e).__name__}: {e}; reading the local files under {sweep_dir}",
                stacklevel=2,
            )
    if sweep_dir is None:
        raise ValueError("load_sweep: give a sweep dir, a wandb path, or both")
    return load_local(sweep_dir)
