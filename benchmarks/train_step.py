"""A default `train.py` step's wall time with rollout.scheduler=static vs continuous, in alternating runs.

    python benchmarks/train_step.py                         # 3 runs each of 4 steps, the default config
    python benchmarks/train_step.py --runs 5 --steps 6 --json /tmp/engine/train_step.json -- rollout.n=16

Each run is a fresh `python train.py logger=none steps=S rollout.scheduler=X` (plus any overrides after
`--`); the step time is metrics.jsonl's `timing_s/step` (and `timing_s/rollout` where logged), the first
step dropped (the engine's workers start, the numerics preflight runs). Runs alternate static, continuous,
static, ... so a shared machine's load falls on both alike; the medians over every kept step are compared
side by side. The fingerprints (`fp/*`) of the two schedulers are compared too: under determinism=on they
are equal at every step (the schedule is no source of bits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = ("static", "continuous")


def run(scheduler: str, steps: int, overrides: list[str], where: Path) -> list[dict]:
    """One train.py run; -> its metrics.jsonl rows."""
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", f"steps={steps}",
           f"rollout.scheduler={scheduler}", f"hydra.run.dir={where}", *overrides]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per scheduler (alternating)")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args()
    print(f"settings: runs={args.runs} steps={args.steps} overrides={args.overrides or 'none'}")
    times: dict[str, dict[str, list[float]]] = {s: {"step": [], "rollout": []} for s in SCHEDULERS}
    fps: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            for s in SCHEDULERS:
                rows = run(s, args.steps, args.overrides, Path(tmp) / f"{s}_{r}")
                for row in rows[1:]:
                    times[s]["step"].append(row["timing_s/step"])
                    if "timing_s/rollout" in row:
                        times[s]["rollout"].append(row["timing_s/rollout"])
                fps[s] = [{k: v for k, v in row.items() if k.startswith("fp/")} for row in rows]
    med = {s: {k: statistics.median(v) if v else None for k, v in t.items()} for s, t in times.items()}
    out = {
        "median_s": med,
        "all_s": times,
        "ratio": {"continuous_vs_static_step": med["continuous"]["step"] / med["static"]["step"]},
        "fingerprints_equal": fps["static"] == fps["continuous"],
        "settings": {"runs": args.runs, "steps": args.steps, "overrides": args.overrides},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
