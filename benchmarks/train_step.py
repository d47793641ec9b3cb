"""A default `train.py` step's wall time with rollout.scheduler=static vs continuous, in alternating runs.

    python benchmarks/train_step.py                         # 6 runs each of 4 steps, the default config
    python benchmarks/train_step.py --runs 5 --steps 6 --json /tmp/engine/train_step.json -- rollout.n=16

Each run is a fresh `python train.py logger=none steps=S rollout.scheduler=X` (plus any overrides after
`--`); the step time is metrics.jsonl's `timing_s/step` (and every other `timing_s/*` phase logged), the first
step dropped (the engine's workers start, the numerics preflight runs). Runs alternate in ABBA order (static,
continuous, then continuous, static, ...) so a shared machine's load and any drift fall on both alike; the
medians over every kept step are compared side by side, and so is each round's pair of runs (`per_round`) with
a 95% bootstrap interval on their mean log ratio (`step_ci95`): on a 2-core VM one process's steps run up to
+-25% faster or slower than the next one's, so a single pair says little. The fingerprints (`fp/*`) of the two
schedulers are compared too: under determinism=on they are equal at every step (the schedule is no source of
bits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import scipy.stats

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = ("static", "continuous")


def run(scheduler: str, steps: int, overrides: list[str], where: Path) -> list[dict]:
    """One train.py run; -> its metrics.jsonl rows."""
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", f"steps={steps}",
           f"rollout.scheduler={scheduler}", f"hydra.run.dir={where}", *overrides]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]


def paired(times: dict, runs: int, kept: int) -> dict:
    """Each round's continuous / static ratio of its runs' median steps, and a 95% bootstrap interval on the
    geometric mean of those ratios (the runs' own +-25% spread is what it has to see through)."""
    per_run = {
        s: [statistics.median(t["step"][r * kept : (r + 1) * kept]) for r in range(runs)]
        for s, t in times.items()
    }
    logs = np.log(np.array(per_run["continuous"]) / np.array(per_run["static"]))
    out = {"per_round": [float(x) for x in np.exp(logs)], "step_geomean": float(np.exp(logs.mean()))}
    if runs >= 3:
        ci = scipy.stats.bootstrap(
            (logs,), np.mean, confidence_level=0.95, random_state=0
        ).confidence_interval
        out["step_ci95"] = [float(np.exp(ci.low)), float(np.exp(ci.high))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="runs per scheduler (alternating, ABBA)")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args()
    print(f"settings: runs={args.runs} steps={args.steps} overrides={args.overrides or 'none'}")
    times: dict[str, dict[str, list[float]]] = {s: {} for s in SCHEDULERS}  # timing_s/<phase> -> values
    fps: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            for s in SCHEDULERS if r % 2 == 0 else SCHEDULERS[::-1]:
                rows = run(s, args.steps, args.overrides, Path(tmp) / f"{s}_{r}")
                for row in rows[1:]:
                    for k, v in row.items():
                        if k.startswith("timing_s/"):
                            times[s].setdefault(k.removeprefix("timing_s/"), []).append(v)
                fps[s] = [{k: v for k, v in row.items() if k.startswith("fp/")} for row in rows]
    med = {s: {k: statistics.median(v) if v else None for k, v in t.items()} for s, t in times.items()}
    out = {
        "median_s": med,
        "all_s": times,
        "ratio": {
            "continuous_vs_static_step": med["continuous"]["step"] / med["static"]["step"],
            **{
                f"continuous_vs_static_{k}": med["continuous"][k] / med["static"][k]
                for k in ("rollout", "learn")
            },
            **paired(times, args.runs, args.steps - 1),
        },
        "fingerprints_equal": fps["static"] == fps["continuous"],
        "settings": {"runs": args.runs, "steps": args.steps, "overrides": args.overrides},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "all_s"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
