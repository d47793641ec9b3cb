"""Compare two runs' fingerprints step by step: python scripts/compare_runs.py RUN_A RUN_B."""

import sys

from detrl.analysis.load import load_metrics
from detrl.analysis.verdicts import differing, first_divergence

a, b = load_metrics(sys.argv[1]), load_metrics(sys.argv[2])
key = "mismatch/train_rollout_logprob_abs_diff"
for ra, rb in zip(a, b):
    diff = differing(ra, rb)
    print(
        f"step {ra.get('step', '?')}: " + (f"differ in {diff}" if diff else "identical") + f"  {key} "
        f"{ra.get(key, float('nan')):.3g} / {rb.get(key, float('nan')):.3g}"
    )
print(f"{len(a)} vs {len(b)} steps; first divergence: {first_divergence(a, b) or 'none'}")
