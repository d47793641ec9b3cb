"""What determinism costs and what `off` changes, measured side by side in one process.

    python benchmarks/determinism.py                 # default config, dense and MoE, 5 repeats each
    python benchmarks/determinism.py --steps 20 --repeats 3 --models qwen3

For each model, runs of `determinism=on` and `off` alternate (on, off, on, off, ...) so that machine
noise hits both alike. Prints the median step time of each (first 2 steps dropped), their ratio, how
many distinct trajectories the repeats gave, and where the first divergence from repeat 0 happened.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir

from detrl.analysis import distinct_trajectories, first_divergence, load_metrics
from detrl.config import register_configs, to_typed
from detrl.trainer import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def run(overrides: list[str], out: Path) -> list[dict]:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_typed(compose("train", overrides=overrides + ["logger=none", "checkpoint.save_final=false"]))
    train(cfg, out)
    return load_metrics(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["qwen3", "qwen3_moe"])
    ap.add_argument(
        "--json", type=Path, help="also write the table's rows here, one object per (model, determinism)"
    )
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    register_configs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            runs: dict[str, list[list[dict]]] = {"on": [], "off": []}
            for rep in range(args.repeats):
                for mode in ("on", "off"):
                    out = Path(tmp) / f"{model}-{mode}-{rep}"
                    runs[mode].append(
                        run(
                            [f"model={model}", f"determinism={mode}", f"steps={args.steps}", *args.overrides],
                            out,
                        )
                    )
            med = {
                m: statistics.median(r["timing_s/step"] for run_ in rs for r in run_[2:])
                for m, rs in runs.items()
            }
            for mode, rs in runs.items():
                divs = [first_divergence(rs[0], other) for other in rs[1:]]
                where = Counter(d[1] for d in divs if d)
                steps = sorted(d[0] for d in divs if d)
                rows.append(
                    (
                        model,
                        mode,
                        med[mode],
                        med[mode] / med["off"],
                        distinct_trajectories(rs),
                        len(rs),
                        steps[0] if steps else "-",
                        ", ".join(f"{k} x{v}" for k, v in where.items()) or "-",
                        sum(r["critic/score/mean"] for r in rs[0][-5:]) / 5,
                    )
                )
    print(f"\n{args.steps} steps x {args.repeats} repeats per cell, on/off alternating in one process\n")
    print(
        "| model | determinism | median step (s) | vs off | distinct trajectories | earliest divergence step "
        "| first diverging fingerprint | reward last 5 (repeat 0) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m, mode, t, ratio, d, n, first, where, rew in rows:
        print(f"| {m} | {mode} | {t:.3f} | {ratio:.2f}x | {d} of {n} | {first} | {where} | {rew:.3f} |")
    if args.json:
        keys = ("model", "determinism", "median_step_s", "vs_off", "distinct_trajectories", "repeats",
                "earliest_divergence_step", "first_diverging_fingerprint", "reward_last5")  # fmt: skip
        figures = {
            "steps": args.steps,
            "overrides": args.overrides,
            "rows": [dict(zip(keys, r)) for r in rows],
        }
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
