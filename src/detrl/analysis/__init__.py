"""Load a sweep and compare its runs step by step: whether they differ (fingerprints), where they first
part (step and pipeline stage), and how far they drift apart (sketch distances).

    >>> sweep = load_sweep("outputs/sweeps/smoke_...")          # doctest: +SKIP
    >>> verdicts(sweep)                                          # doctest: +SKIP
    >>> distances(sweep, "param")                                # doctest: +SKIP

- `load`: local run dirs, or a W&B group through the public API (falling back to the local files);
- `verdicts`: fingerprints -> per-cell verdicts, the divergence matrix, metric spreads;
- `drift`: sketches -> distances between repeats per step;
- `findings`: the few sentences a report opens with, computed from the tables above.
"""

from detrl.analysis.drift import distances, pair_distance
from detrl.analysis.findings import findings
from detrl.analysis.load import Sweep, load_drift, load_local, load_metrics, load_sweep, load_wandb
from detrl.analysis.verdicts import (
    FP_ORDER,
    STAGE,
    STAGES,
    differing,
    distinct_trajectories,
    divergence_matrix,
    first_divergence,
    pair_divergences,
    spread,
    trajectory,
    verdicts,
)

__all__ = [
    "FP_ORDER",
    "STAGE",
    "STAGES",
    "Sweep",
    "differing",
    "distances",
    "distinct_trajectories",
    "divergence_matrix",
    "findings",
    "first_divergence",
    "load_drift",
    "load_local",
    "load_metrics",
    "load_sweep",
    "load_wandb",
    "pair_distance",
    "pair_divergences",
    "spread",
    "trajectory",
    "verdicts",
]
