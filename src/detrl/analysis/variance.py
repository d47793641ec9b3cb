"""How much of a run's spread is the seed's, and how much nondeterministic repeats of one seed add.

Nested random effects, one configuration at a time: run j of seed i gives y_ij = mu + s_i + e_ij, with
s_i ~ (0, between) the seed's effect (data order, eval split, sampling seeds) and e_ij ~ (0, within) what a
repeat of the same seed adds (exactly 0 under `determinism=on`). The components are the one-way ANOVA
(method-of-moments) estimates, unbalanced designs through n0 (Searle, Casella & McCulloch, "Variance
Components", 1992, sec. 3.5); a negative between estimate is truncated at 0.

Intervals come from a two-stage (hierarchical) bootstrap: resample seeds with replacement, then repeats with
replacement within each drawn seed, on values shrunk as Davison & Hinkley ("Bootstrap Methods and their
Application", 1997, sec. 3.8) prescribe, so that the resampled mean squares are unbiased for the observed ones
(plain two-stage resampling shrinks the within part by (n-1)/n and inflates the between part by it).

`seeds_needed` is the power line: seeds per configuration for a two-sided two-sample t-test (one run a seed) to
detect a given difference at a given power, from the noncentral t (scipy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

SUMMARY_FIELDS = ("mean", "between", "within", "total", "ratio")


@dataclass(frozen=True)
class Components:
    """Point estimates of one configuration, with `lo` / `hi` interval bounds per field of SUMMARY_FIELDS."""

    mean: float  # mean of the seed means (each seed weighs the same)
    between: float  # between-seed variance
    within: float  # within-seed (repeat) variance; NaN with one run per seed
    seeds: int
    runs: int
    lo: dict[str, float]
    hi: dict[str, float]
    values: pd.DataFrame | None = field(default=None, repr=False, compare=False)  # the runs decomposed

    @property
    def total(self) -> float:
        """Variance of one run: seed + repeat."""
        return self.between + (0.0 if np.isnan(self.within) else self.within)

    @property
    def ratio(self) -> float:
        """within / between: what a repeat adds, as a fraction of the seed variance (NaN when between is 0)."""
        return _ratio(self.within, self.between)

    def interval(self, name: str) -> tuple[float, float]:
        return self.lo[name], self.hi[name]


def _ratio(within, between):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.asarray(between) > 0, np.asarray(within) / np.asarray(between), np.nan)[()]


def seed_matrix(df: pd.DataFrame, value: str = "value", seed: str = "seed") -> np.ndarray:
    """[seeds, max repeats] of `value`, NaN-padded, seeds in sorted order; rows with a NaN value are dropped."""
    df = df[[seed, value]].dropna()
    groups = [g[value].to_numpy(dtype=np.float64) for _, g in df.groupby(seed, sort=True)]
    if not groups:
        raise ValueError(f"no values of {value!r} to decompose")
    out = np.full((len(groups), max(len(g) for g in groups)), np.nan)
    for i, g in enumerate(groups):
        out[i, : len(g)] = g
    return out


def _mean_squares(y: np.ndarray):
    """(seed means, grand mean, MS between, MS within, n0) of NaN-padded [..., seeds, repeats] arrays."""
    ok = ~np.isnan(y)
    n_i = ok.sum(-1)  # [..., a]
    a, big_n = y.shape[-2], n_i.sum(-1)
    # each seed centred on its first run: identical repeats give residuals of exactly 0 (not rounding's 1e-17)
    first = y[..., :1]
    d = np.where(ok, y - first, 0.0)
    offset = d.sum(-1) / n_i  # [..., a]
    means = first[..., 0] + offset
    grand = (n_i * means).sum(-1) / big_n
    ss_w = (np.where(ok, d - offset[..., None], 0.0) ** 2).sum((-2, -1))
    ss_b = (n_i * (means - grand[..., None]) ** 2).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ms_w = np.where(big_n > a, ss_w / (big_n - a), np.nan)
        ms_b = ss_b / (a - 1) if a > 1 else np.full_like(ss_b, np.nan)
        n0 = (big_n - (n_i**2).sum(-1) / big_n) / (a - 1) if a > 1 else np.ones_like(ss_b)
    return means, grand, ms_b, ms_w, n0


def anova(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean of seed means, between, within) of NaN-padded [..., seeds, repeats] arrays, over the leading dims.
    With one run per seed nothing separates the parts: between is then the whole variance, within NaN."""
    means, _, ms_b, ms_w, n0 = _mean_squares(y)
    between = np.where(np.isnan(ms_w), ms_b, np.maximum(0.0, (ms_b - ms_w) / n0))
    return means.mean(-1), between, ms_w


def bootstrap_draws(y: np.ndarray, n_boot: int = 2000, rng: int | np.random.Generator = 0) -> np.ndarray:
    """[n_boot, seeds, repeats] resamples of `y` (NaN-padded [seeds, repeats]): seeds with replacement, then
    repeats with replacement within each drawn seed, after Davison & Hinkley's shrinkage of the seed means and
    residuals (so that the resamples' mean squares are unbiased for the observed ones)."""
    rng = np.random.default_rng(rng)
    n_i = (~np.isnan(y)).sum(-1)
    a, width = y.shape
    means, grand, ms_b, ms_w, _ = _mean_squares(y)
    c_r = np.sqrt(np.where(n_i > 1, n_i / np.maximum(n_i - 1, 1), 0.0))  # residuals: unbiased within spread
    if np.isnan(ms_w):  # one run per seed: the seed means carry everything
        share = 1.0
    else:  # the seed means already hold ms_w / n of repeat noise, which stage 2 adds again
        share = max(0.0, 1.0 - ms_w / ms_b) if ms_b > 0 else 0.0
    c_s = np.sqrt(a / (a - 1) * share) if a > 1 else 0.0
    adjusted = (
        grand + c_s * (means - grand)[:, None] + c_r[:, None] * (y - means[:, None])
    )  # NaN where padded
    seeds = rng.integers(0, a, size=(n_boot, a))  # stage 1
    counts = n_i[seeds]  # [B, a]: each drawn seed keeps its own number of runs
    picks = (rng.random((n_boot, a, width)) * counts[..., None]).astype(np.int64)  # stage 2
    draws = adjusted[seeds[..., None], picks]
    draws[np.arange(width)[None, None, :] >= counts[..., None]] = np.nan
    return draws


def decompose(
    df: pd.DataFrame,
    value: str = "value",
    seed: str = "seed",
    n_boot: int = 2000,
    level: float = 0.95,
    rng: int | np.random.Generator = 0,
) -> Components:
    """Between-seed and within-seed variance of `df[value]` (one row per run, `df[seed]` its seed), with
    percentile intervals at `level` from the hierarchical bootstrap."""
    y = seed_matrix(df, value, seed)
    mean, between, within = (float(v) for v in anova(y))
    b_mean, b_between, b_within = anova(bootstrap_draws(y, n_boot, rng))
    boot = {
        "mean": b_mean,
        "between": b_between,
        "within": b_within,
        "total": b_between + np.nan_to_num(b_within),
        "ratio": _ratio(b_within, b_between),
    }
    q = ((1 - level) / 2, (1 + level) / 2)
    lo, hi = {}, {}
    for k, v in boot.items():
        v = v[~np.isnan(v)]
        lo[k], hi[k] = (float(x) for x in np.quantile(v, q)) if len(v) else (np.nan, np.nan)
    runs = int((~np.isnan(y)).sum())
    return Components(mean, between, within, y.shape[0], runs, lo, hi, df[[seed, value]])


def added_share(
    off: pd.DataFrame,
    on: pd.DataFrame,
    value: str = "value",
    seed: str = "seed",
    n_boot: int = 2000,
    level: float = 0.95,
    rng: int = 0,
) -> tuple[float, float, float]:
    """(estimate, lo, hi) of within(off) / between(on): the repeat variance that `determinism=off` adds, as a
    share of the seed variance measured where it is the only part (`on`: repeats identical). The two sweeps'
    halves are bootstrapped independently (each hierarchically)."""
    y_off, y_on = seed_matrix(off, value, seed), seed_matrix(on, value, seed)
    est = float(_ratio(anova(y_off)[2], anova(y_on)[1]))
    gen = np.random.default_rng(rng)
    draws = _ratio(
        anova(bootstrap_draws(y_off, n_boot, gen))[2], anova(bootstrap_draws(y_on, n_boot, gen))[1]
    )
    draws = draws[~np.isnan(draws)]
    if not len(draws):
        return est, np.nan, np.nan
    lo, hi = np.quantile(draws, ((1 - level) / 2, (1 + level) / 2))
    return est, float(lo), float(hi)


def decompose_steps(
    df: pd.DataFrame,
    value: str = "value",
    seed: str = "seed",
    step: str = "step",
    n_boot: int = 500,
    level: float = 0.95,
    rng: int = 0,
) -> pd.DataFrame:
    """`decompose` at every step: one row per step with mean, between, within, ratio and their bounds."""
    rows = []
    for t, g in df.groupby(step, sort=True):
        if g[value].notna().sum() < 2:
            continue
        c = decompose(g, value, seed, n_boot, level, rng)
        rows.append(
            {
                step: t,
                **{k: getattr(c, k) for k in SUMMARY_FIELDS},
                **{f"{k}_lo": c.lo[k] for k in SUMMARY_FIELDS},
                **{f"{k}_hi": c.hi[k] for k in SUMMARY_FIELDS},
            }
        )
    return pd.DataFrame(rows)


def power(n: int, variance: float, delta: float, alpha: float = 0.05) -> float:
    """Power of a two-sided two-sample t-test with `n` runs per arm, per-run `variance`, true difference `delta`."""
    if n < 2:
        return 0.0
    if variance <= 0:
        return 1.0 if delta != 0 else alpha
    df = 2 * n - 2
    ncp = abs(delta) / np.sqrt(2 * variance / n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def seeds_needed(
    variance: float, delta: float, target: float = 0.8, alpha: float = 0.05, max_n: int = 100_000
) -> int:
    """Fewest seeds per configuration (one run each, per-run `variance`) for a two-sided t-test at `alpha` to
    detect a difference `delta` with power >= `target`; 2 when the variance is 0 (a t-test needs two a side)."""
    if delta == 0:
        raise ValueError("delta must be non-zero")
    lo, hi = 2, 2
    while power(hi, variance, delta, alpha) < target:
        lo, hi = hi, hi * 2
        if hi > max_n:
            return max_n
    while lo < hi:  # power grows with n: the first n reaching the target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(mid, variance, delta, alpha) < target else (lo, mid)
    return hi


# ---------------------------------------------------------------- a sweep's runs as (config, seed, repeat, value)

_SEED_IN_NAME = re.compile(r"_s(\d+)_r\d+$")  # W&B run names: <cell>_s<seed>_r<repeat>


def seed_of(cell: str, run: str) -> int:
    """The run's seed: its cell's `seed=` override, else the `_s<seed>_r<repeat>` of its run name, else 0."""
    for part in cell.split(","):
        if part.startswith("seed="):
            return int(part.split("=", 1)[1])
    m = _SEED_IN_NAME.search(run)
    return int(m.group(1)) if m else 0


def config_of(cell: str) -> str:
    """A cell without its seed: runs of one config differ only by seed and repeat."""
    return ",".join(p for p in cell.split(",") if not p.startswith("seed=")) or "default"


def step_values(sweep, metric: str) -> pd.DataFrame:
    """One row per (complete run, logged step): config, seed, repeat, step, value (NaN where not logged)."""
    if metric not in sweep.metrics.columns:
        raise KeyError(
            f"metric {metric!r} is not in this sweep; choose one of {sorted(sweep.metrics.columns)[:40]}"
        )
    runs = sweep.runs[sweep.runs.status == "complete"]
    m = sweep.metrics[sweep.metrics.run.isin(runs.run)][["run", "cell", "repeat", "step", metric]]
    m = m.rename(columns={metric: "value"})
    m["value"] = pd.to_numeric(m["value"], errors="coerce")
    m["seed"] = [seed_of(c, r) for c, r in zip(m.cell, m.run)]
    m["config"] = m.cell.map(config_of)
    return m[["run", "config", "seed", "repeat", "step", "value"]]


def run_values(sweep, metric: str = "critic/score/mean", window: int = 5) -> pd.DataFrame:
    """One row per complete run: config, seed, repeat, value = the mean of the metric's last `window` logged
    (non-NaN) values; window=1 is the last value (an eval metric: the last eval)."""
    if window < 1:
        raise ValueError(f"window={window} is not valid: must be >= 1")
    m = step_values(sweep, metric).dropna(subset=["value"]).sort_values(["run", "step"])
    tail = m.groupby("run", sort=False).tail(window)
    out = tail.groupby(["run", "config", "seed", "repeat"], as_index=False).value.mean()
    return out.sort_values(["config", "seed", "repeat"]).reset_index(drop=True)
