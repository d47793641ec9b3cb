"""How far a cell's repeats drift apart: distances between their sketches (see `detrl.fingerprint`).

`param`: the L2 distance between two runs' parameters at a step, estimated from their `param_sketch`
(a fixed Johnson-Lindenstrauss projection: ~4% relative error per estimate). `logprob`: the L2 distance
between their per-prompt mean rollout logprobs (keyed by prompt uid), from `logprob_sketch`.
Where the matching fingerprint is equal (fp/params, fp/rollout_logprobs) the distance is exactly 0.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pandas as pd

from detrl.analysis.load import Sweep

_KIND = {"param": ("param_sketch", "fp/params"), "logprob": ("logprob_sketch", "fp/rollout_logprobs")}


def pair_distance(sweep: Sweep, a: str, b: str, kind: str = "param") -> dict[int, float]:
    """step -> estimated L2 distance between runs a and b (0.0 exactly where their fingerprint is equal),
    over the steps both logged a sketch."""
    key, fp = _KIND[kind]
    fa = {r["step"]: r.get(fp) for r in sweep.rows.get(a, [])}
    fb = {r["step"]: r.get(fp) for r in sweep.rows.get(b, [])}
    da, db = sweep.drift.get(a, {}), sweep.drift.get(b, {})
    out = {}
    for step in sorted(set(da) & set(db)):
        same = fa.get(step) is not None and fa.get(step) == fb.get(step)
        out[step] = 0.0 if same else float(np.linalg.norm(da[step][key] - db[step][key]))
    return out


def distances(sweep: Sweep, kind: str = "param") -> pd.DataFrame:
    """Per cell and step, over all pairs of its complete repeats: median / min / max distance, the number
    of pairs, and how many of them are exactly 0. Empty when the runs logged no drift sketches."""
    out = []
    for cell, runs in sweep.runs.groupby("cell", sort=True):
        names = list(runs[runs.status == "complete"].sort_values("repeat").run)
        per_step: dict[int, list[float]] = {}
        for a, b in combinations(names, 2):
            for step, d in pair_distance(sweep, a, b, kind).items():
                per_step.setdefault(step, []).append(d)
        for step, ds in sorted(per_step.items()):
            out.append(
                {
                    "cell": cell,
                    "step": step,
                    "median": float(np.median(ds)),
                    "min": min(ds),
                    "max": max(ds),
                    "pairs": len(ds),
                    "zero_pairs": sum(d == 0.0 for d in ds),
                }
            )
    return pd.DataFrame(out, columns=["cell", "step", "median", "min", "max", "pairs", "zero_pairs"])
