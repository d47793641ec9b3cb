"""A/B comparison of two configurations' runs, with an interval that accounts for seed and repeat variance.

    python -m detrl.compare SWEEP_A SWEEP_B [--metric critic/score/mean] [--window 5] [--where determinism=off]
        [--where-b model=qwen3_moe]   (B's cells, when they differ from A's: two configs of one sweep)

SWEEP_A / SWEEP_B: a local sweep dir, or a W&B group `wandb:ENTITY/PROJECT/GROUP` (read through
`detrl.analysis.load_sweep`). Each side's runs (complete ones, optionally only the cells matching every
`--where key=value`) must be one config: seeds x repeats. Per run the metric is summarised as the mean of its
last `--window` logged values; a side's mean is the mean of its seed means. The 95% interval of A - B comes from
the hierarchical bootstrap of each side (seeds, then repeats within them; `detrl.analysis.variance`).

The verdict compares the difference with the nondeterminism noise measured in the sweeps: the repeat (within-seed)
variance of each side, which alone would move A - B by +-1.96 sqrt(within_A / runs_A + within_B / runs_B).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from detrl.analysis.load import Sweep, load_sweep
from detrl.analysis.variance import anova, bootstrap_draws, decompose, run_values, seed_matrix


@dataclass(frozen=True)
class Comparison:
    metric: str
    window: int
    diff: float  # mean(A) - mean(B)
    lo: float
    hi: float
    noise: float  # half-width of the band the repeat variance alone gives the difference (0 under on)
    mean_a: float
    mean_b: float
    seed_sd: tuple[float, float]  # between-seed sd of A, B
    repeat_sd: tuple[float, float]  # within-seed sd of A, B (NaN: one run per seed)
    runs: tuple[int, int]
    seeds: tuple[int, int]

    @property
    def differs(self) -> bool:
        """The interval excludes 0 and the difference is larger than the nondeterminism noise band."""
        return (self.lo > 0 or self.hi < 0) and abs(self.diff) > self.noise

    def verdict(self) -> str:
        d = f"A - B = {self.diff:+.4g} (95% interval [{self.lo:+.4g}, {self.hi:+.4g}])"
        where = (
            f"{self.metric}, mean of the last {self.window} steps; A {self.mean_a:.4g}, B {self.mean_b:.4g}"
        )
        noise = (
            f"nondeterminism noise +-{self.noise:.2g} (repeat sd {_sd(self.repeat_sd)}, seed sd "
            f"{_sd(self.seed_sd)}; {self.seeds[0]}/{self.seeds[1]} seeds, {self.runs[0]}/{self.runs[1]} runs)"
        )
        if self.differs:
            return f"different: {d} exceeds the {noise} [{where}]"
        why = "the interval includes 0" if self.lo <= 0 <= self.hi else "within the noise band"
        return f"no difference beyond the noise: {d}, {why}; {noise} [{where}]"


def _sd(pair: tuple[float, float]) -> str:
    return "/".join("-" if np.isnan(v) else f"{v:.2g}" for v in pair)


def side(sweep: Sweep, metric: str, window: int, where: list[str], name: str) -> pd.DataFrame:
    """One side's runs (config, seed, repeat, value); fails in one line unless they are one config."""
    vals = run_values(sweep, metric, window)
    for w in where:
        vals = vals[vals.config.map(lambda c, w=w: w in c.split(","))]
    configs = sorted(vals.config.unique())
    if not configs:
        raise ValueError(f"{name}: no complete run with {metric!r}" + (f" matching {where}" if where else ""))
    if len(configs) > 1:
        raise ValueError(
            f"{name} holds {len(configs)} configs {configs}: choose one with --where key=value "
            "(e.g. --where determinism=off)"
        )
    return vals


def compare(
    a: Sweep,
    b: Sweep,
    metric: str = "critic/score/mean",
    window: int = 5,
    where: list[str] | None = None,
    n_boot: int = 4000,
    rng: int = 0,
    where_b: list[str] | None = None,
) -> Comparison:
    """A - B of the metric's per-run summary, its 95% interval (hierarchical bootstrap of each side) and the
    band the repeat variance alone would give it. `where` selects cells on both sides, `where_b` (when given)
    on B instead."""
    va = side(a, metric, window, where or [], "A")
    vb = side(b, metric, window, where or [] if where_b is None else where_b, "B")
    ca, cb = decompose(va, n_boot=200, rng=rng), decompose(vb, n_boot=200, rng=rng)
    gen = np.random.default_rng(rng)
    ya, yb = seed_matrix(va), seed_matrix(vb)
    draws = anova(bootstrap_draws(ya, n_boot, gen))[0] - anova(bootstrap_draws(yb, n_boot, gen))[0]
    lo, hi = np.quantile(draws, (0.025, 0.975))
    within = [0.0 if np.isnan(c.within) else c.within for c in (ca, cb)]
    noise = 1.96 * np.sqrt(within[0] / ca.runs + within[1] / cb.runs)
    return Comparison(
        metric,
        window,
        ca.mean - cb.mean,
        float(lo),
        float(hi),
        float(noise),
        ca.mean,
        cb.mean,
        (float(np.sqrt(ca.between)), float(np.sqrt(cb.between))),
        (float(np.sqrt(ca.within)), float(np.sqrt(cb.within))),
        (ca.runs, cb.runs),
        (ca.seeds, cb.seeds),
    )


def load(source: str, api=None) -> Sweep:
    """A local sweep dir, or `wandb:ENTITY/PROJECT/GROUP`."""
    if source.startswith("wandb:"):
        return load_sweep(None, wandb_path=source[len("wandb:") :], api=api)
    if not Path(source).is_dir():
        raise FileNotFoundError(f"{source!r} is not a sweep dir (or give wandb:ENTITY/PROJECT/GROUP)")
    return load_sweep(source)


def main(argv: list[str] | None = None, api=None) -> Comparison:
    ap = argparse.ArgumentParser(prog="python -m detrl.compare", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_a", help="sweep dir or wandb:ENTITY/PROJECT/GROUP")
    ap.add_argument("sweep_b", help="sweep dir or wandb:ENTITY/PROJECT/GROUP")
    ap.add_argument("--metric", default="critic/score/mean")
    ap.add_argument("--window", type=int, default=5, help="mean of the last N logged values of a run")
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="keep matching cells")
    ap.add_argument(
        "--where-b", action="append", default=None, metavar="KEY=VALUE", help="B's, if not --where"
    )
    args = ap.parse_args(argv)
    try:
        a, b = load(args.sweep_a, api), load(args.sweep_b, api)
        c = compare(a, b, args.metric, args.window, args.where, where_b=args.where_b)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"detrl.compare: {e.args[0] if e.args else e}", file=sys.stderr)
        sys.exit(2)
    print(c.verdict())
    return c


if __name__ == "__main__":
    main()
