"""Compare two runs' fingerprints step by step: python scripts/compare_runs.py RUN_A RUN_B."""

import json
import sys
from pathlib import Path

KEYS = ("fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order", "fp/params")


def rows(run: str) -> list[dict]:
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


a, b = rows(sys.argv[1]), rows(sys.argv[2])
first = None
for ra, rb in zip(a, b):
    diff = [k for k in KEYS if ra[k] != rb[k]]
    print(
        f"step {ra['step'] if 'step' in ra else '?'}: "
        + (f"differ in {diff}" if diff else "identical")
        + f"  mismatch/train_rollout_logprob_abs_diff {ra['mismatch/train_rollout_logprob_abs_diff']:.3g} / "
        f"{rb['mismatch/train_rollout_logprob_abs_diff']:.3g}"
    )
    if diff and first is None:
        first = (ra.get("step"), diff)
print(f"{len(a)} vs {len(b)} steps; first divergence: {first if first else 'none'}")
