"""Cost of scoring one math response (math-verify) in-process vs through the reward processes.

    python benchmarks/reward_cost.py [--src-before DIR]

Scores 32 groups of 8 DAPO-style responses (boxed fractions, right and wrong, some prose) with `data=math`'s task
at `data.reward_workers=0` and `=2` (timeout 5 s), after one warm-up group (process start excluded), and prints
ms per sample. With `--src-before` (a `src` dir of another commit) each setting also runs on that code, in
alternation, in the same invocation, so the ratio is measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
from detrl.data.math_task import MathTask
workers = int(sys.argv[1])
golds = ["\\frac{%d}{%d}" % (a, a + 1) for a in range(1, 33)]
def group(g):
    a = g % 32 + 1
    return [f"We simplify step by step. First {a}*{k} = {a * k}. So the answer is $\\boxed{{\\frac{{{a * k}}}{{{(a + 1) * k}}}}}$."
            if k % 3 else f"I think it is $\\boxed{{{a + k}}}$" for k in range(1, 9)]
task = MathTask(["q"], ["1"], reward_timeout_s=5.0, reward_workers=workers)
task.score_texts(group(0), golds[0])  # warm-up: processes started, imports done
time.sleep(8)  # let every started process (a spare included) finish its imports before timing
t0, scores = time.perf_counter(), []
for g in range(32):
    scores += task.score_texts(group(g), golds[g % 32])
dt = time.perf_counter() - t0
task.close()
print(json.dumps({"ms_per_sample": 1000 * dt / len(scores), "scores": scores}))
"""


def run(src: str, workers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CHILD, str(workers)], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src-before", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write ms_per_sample per (reward_workers, code) here")
    args = ap.parse_args()
    figures: dict[str, dict] = {}
    here = str(Path(__file__).resolve().parents[1] / "src")
    srcs = {"now": here, **({"before": args.src_before} if args.src_before else {})}
    for workers in (0, 2):
        times = {k: [] for k in srcs}
        scores = {}
        for _ in range(args.repeats):
            for name, src in srcs.items():
                r = run(src, workers)
                times[name].append(r["ms_per_sample"])
                scores[name] = r["scores"]
        same = len({json.dumps(s) for s in scores.values()}) == 1
        row = ", ".join(f"{k} {min(v):.2f} ms/sample" for k, v in times.items())
        print(f"reward_workers={workers}: {row}; scores identical across code: {same}")
        figures[f"reward_workers={workers}"] = {
            "ms_per_sample": {k: min(v) for k, v in times.items()},
            "same_scores": same,
        }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
