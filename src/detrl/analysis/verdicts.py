"""Whether a cell's repeats differ, and where they first part: step and pipeline stage.

A step produces, in this order: the batch order (which sample sits where), the sampled tokens, their
rollout logprobs, then the trainer's new parameters. The content fingerprints do not depend on the
order (see `detrl.fingerprint`), so the first stage that differs at the first differing step says where
nondeterminism entered: `order` (only the result order: completion order under `determinism=off`),
`tokens` / `logprobs` (the engine sampled other tokens, or the same tokens with other logprob bits),
`params` (same batch, same bits, yet the trainer's update differs).
"""

from __future__ import annotations

from itertools import combinations

import pandas as pd

from detrl.analysis.load import Sweep

# pipeline order: the first one to differ says where nondeterminism entered
FP_ORDER = ("fp/batch_order", "fp/rollout_tokens", "fp/rollout_logprobs", "fp/params")
STAGE = {
    "fp/batch_order": "order",
    "fp/rollout_tokens": "tokens",
    "fp/rollout_logprobs": "logprobs",
    "fp/params": "params",
}
STAGES = tuple(STAGE[k] for k in FP_ORDER)


def differing(ra: dict, rb: dict) -> list[str]:
    """The fingerprints that differ between two rows of one step, in pipeline order."""
    return [k for k in FP_ORDER if ra.get(k) != rb.get(k)]


def first_divergence(a: list[dict], b: list[dict]) -> tuple[int, str] | None:
    """(step, fingerprint key) of the first difference between two runs over their common steps: the first
    differing step, and at that step the first differing fingerprint in pipeline order.

    >>> row = {"step": 1, **dict.fromkeys(FP_ORDER, "x")}
    >>> first_divergence([row], [row]) is None, first_divergence([row], [{**row, "fp/params": "y"}])
    (True, (1, 'fp/params'))
    >>> first_divergence([row], [{**row, "fp/params": "y", "fp/batch_order": "y"}])
    (1, 'fp/batch_order')
    """
    for ra, rb in zip(a, b):
        d = differing(ra, rb)
        if d:
            return ra["step"], d[0]
    return None


def trajectory(rows: list[dict], upto: int | None = None) -> tuple:
    return tuple(tuple(r.get(k) for k in FP_ORDER) for r in rows[:upto])


def distinct_trajectories(runs: list[list[dict]]) -> int:
    common = min((len(r) for r in runs), default=0)
    return len({trajectory(r, common) for r in runs})


def _complete(sweep: Sweep, runs: pd.DataFrame) -> list[str]:
    return list(runs[runs.status == "complete"].sort_values("repeat").run)


def _per_run(m: pd.DataFrame, key: str, per_run: str, across: str) -> float | None:
    """`key` aggregated per run, then across runs (None when no run logged it)."""
    if not len(m) or key not in m:
        return None
    return m.groupby("run")[key].agg(per_run).agg(across)


def verdicts(sweep: Sweep) -> pd.DataFrame:
    """Per cell: complete repeats, distinct trajectories, the first divergence over all pairs of repeats
    (step, first stage in pipeline order, and every stage that differs at that step), and the cell's reward,
    step time (median over runs of each run's median), trainer/rollout mismatch and the parameter distance
    between repeats at the last step. Computed once per loaded sweep (every figure and the summary read it)."""
    if "verdicts" not in sweep.memo:
        sweep.memo["verdicts"] = _verdicts(sweep)
    return sweep.memo["verdicts"].copy()


def _verdicts(sweep: Sweep) -> pd.DataFrame:
    from detrl.analysis.drift import distances

    dist = distances(sweep, "param")
    out = []
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        names = _complete(sweep, runs)
        rows = [sweep.rows[r] for r in names]
        first, stages = None, []
        for a, b in combinations(rows, 2):
            d = first_divergence(a, b)
            if d and (first is None or (d[0], FP_ORDER.index(d[1])) < (first[0], FP_ORDER.index(first[1]))):
                first = d
        if first:  # every stage that differs at that step in any pair
            keys = set()
            for a, b in combinations(rows, 2):
                ra = next((r for r in a if r["step"] == first[0]), {})
                rb = next((r for r in b if r["step"] == first[0]), {})
                keys |= set(differing(ra, rb)) if ra and rb else set()
            stages = [STAGE[k] for k in FP_ORDER if k in keys]
        m = sweep.metrics[sweep.metrics.run.isin(names)] if len(sweep.metrics) else sweep.metrics
        n = distinct_trajectories(rows) if rows else 0
        verdict = (
            ("1 complete repeat: nothing to compare" if rows else "no complete repeat")
            if len(rows) < 2
            else "bitwise identical"
            if n == 1
            else f"diverges at step {first[0]} in {STAGE[first[1]]}"
        )
        d = dist[dist.cell == cell]
        out.append(
            {
                "cell": cell,
                "determinism": runs.determinism.iloc[0],
                "repeats": len(rows),
                "incomplete": int((runs.status != "complete").sum()),
                "distinct_trajectories": n,
                "first_divergence_step": first[0] if first else None,
                "first_divergence_stage": STAGE[first[1]] if first else None,
                "first_divergence_fp": first[1] if first else None,
                "stages_differing_then": "+".join(stages) if stages else None,
                "reward_last": _per_run(m, "critic/score/mean", "last", "mean"),
                "step_time_s": _per_run(m, "timing_s/step", "median", "median"),
                "mismatch_max": _per_run(m, "mismatch/train_rollout_logprob_abs_diff_max", "max", "max"),
                "param_distance_last": d.sort_values("step")["median"].iloc[-1] if len(d) else None,
                "verdict": verdict,
            }
        )
    return pd.DataFrame(out)


def pair_divergences(sweep: Sweep) -> pd.DataFrame:
    """One row per pair of complete repeats of a cell: the first step where they differ, every stage that
    differs there, and their parameter distance at that step (a pure reordering parts by rounding, ~1e-8;
    other tokens by ~0.1-1)."""
    from detrl.analysis.drift import pair_distance

    out = []
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        for a, b in combinations(_complete(sweep, runs), 2):
            d = first_divergence(sweep.rows[a], sweep.rows[b])
            if d is None:
                continue
            ra = next(r for r in sweep.rows[a] if r["step"] == d[0])
            rb = next(r for r in sweep.rows[b] if r["step"] == d[0])
            out.append(
                {
                    "cell": cell,
                    "a": a,
                    "b": b,
                    "step": d[0],
                    "stages": "+".join(STAGE[k] for k in differing(ra, rb)),
                    "param_distance": pair_distance(sweep, a, b).get(d[0]),
                }
            )
    return pd.DataFrame(out, columns=["cell", "a", "b", "step", "stages", "param_distance"])


def divergence_matrix(sweep: Sweep) -> pd.DataFrame:
    """cells x steps: how many distinct fingerprint histories the complete repeats have up to that step."""
    table = {}
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        rows = [sweep.rows[r] for r in _complete(sweep, runs)]
        if not rows:
            continue
        common = min(len(r) for r in rows)
        table[cell] = {t + 1: len({trajectory(r, t + 1) for r in rows}) for t in range(common)}
    return pd.DataFrame(table).T.sort_index()


def spread(sweep: Sweep, metric: str) -> pd.DataFrame:
    """Per cell and step: mean / min / max / std of `metric` across the cell's complete repeats."""
    complete = sweep.runs[sweep.runs.status == "complete"].run
    m = sweep.metrics[sweep.metrics.run.isin(complete)] if len(sweep.metrics) else sweep.metrics
    if metric not in m:
        return pd.DataFrame(columns=["cell", "step", "mean", "min", "max", "std"])
    return m.groupby(["cell", "step"])[metric].agg(["mean", "min", "max", "std"]).reset_index()
