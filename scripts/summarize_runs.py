"""One line per run dir: steps, response lengths, reward, trainer/rollout mismatch, median step and rollout time.

python scripts/summarize_runs.py RUN_DIR [RUN_DIR ...]
"""

import statistics
import sys

from detrl.analysis.load import load_metrics

MISMATCH = "mismatch/train_rollout_logprob_abs_diff"


def summary(run_dir: str) -> str:
    rows = load_metrics(run_dir)

    def col(key):
        return [r[key] for r in rows if key in r]

    def med(key):
        v = col(key)
        return f"{statistics.median(v):.3f}" if v else "-"

    lens, score, mis = col("response_length/mean"), col("critic/score/mean"), col(MISMATCH)
    return (
        f"{run_dir}: steps {len(rows)}; response length mean {statistics.mean(lens):.1f} "
        f"(max {max(col('response_length/max'), default=0):.0f}); clip {med('response_length/clip_ratio')}; "
        f"score first {score[0]:.3f} last {score[-1]:.3f} max {max(score):.3f}; "
        f"mismatch max {max(mis, default=float('nan')):.3g}; step {med('timing_s/step')} s; "
        f"rollout {med('timing_s/rollout')} s"
    )


if __name__ == "__main__":
    for d in sys.argv[1:]:
        try:
            print(summary(d))
        except Exception as e:  # a run cut short: say so and go on
            print(f"{d}: no summary ({type(e).__name__}: {e})")
