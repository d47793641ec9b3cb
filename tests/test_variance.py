"""The variance-components estimator, its hierarchical bootstrap and the power line, on synthetic data."""

import numpy as np
import pandas as pd
import pytest

from detrl.analysis.variance import (
    anova,
    bootstrap_draws,
    decompose,
    power,
    seed_matrix,
    seeds_needed,
)


def synthetic(seeds: int, repeats: int, between: float, within: float, rng, mean: float = 0.5):
    """y_ij = mean + s_i + e_ij with known component variances."""
    s = rng.normal(0.0, np.sqrt(between), seeds)
    return pd.DataFrame(
        [
            {"seed": i, "repeat": j, "value": mean + s[i] + rng.normal(0.0, np.sqrt(within))}
            for i in range(seeds)
            for j in range(repeats)
        ]
    )


def test_known_components_fall_inside_their_intervals():
    rng = np.random.default_rng(7)
    df = synthetic(60, 4, between=0.04, within=0.01, rng=rng)
    c = decompose(df, n_boot=1000, rng=1)
    assert c.seeds == 60 and c.runs == 240
    lo, hi = c.interval("between")
    assert lo <= 0.04 <= hi and hi - lo < 0.04  # informative, not [0, inf)
    lo, hi = c.interval("within")
    assert lo <= 0.01 <= hi and hi - lo < 0.01
    lo, hi = c.interval("ratio")
    assert lo <= 0.25 <= hi


def test_intervals_cover_at_about_their_level():
    """Over many synthetic studies the 95% intervals hold the true components most of the time (percentile
    intervals of a variance undercover somewhat at few seeds; 30 seeds here)."""
    rng = np.random.default_rng(0)
    hits_b = hits_w = hits_m = 0
    trials = 60
    for t in range(trials):
        c = decompose(synthetic(30, 3, 1.0, 0.25, rng), n_boot=300, rng=t)
        hits_b += c.lo["between"] <= 1.0 <= c.hi["between"]
        hits_w += c.lo["within"] <= 0.25 <= c.hi["within"]
        hits_m += c.lo["mean"] <= 0.5 <= c.hi["mean"]
    assert hits_b / trials >= 0.75 and hits_w / trials >= 0.85 and hits_m / trials >= 0.85


def test_balanced_anova_is_the_textbook_estimate():
    y = np.array([[1.0, 2.0, 3.0], [4.0, 4.0, 7.0], [0.0, 1.0, 2.0]])
    mean, between, within = anova(y)
    means = y.mean(1)
    assert within == pytest.approx(y.var(1, ddof=1).mean())
    assert between == pytest.approx(means.var(ddof=1) - within / 3)
    assert mean == pytest.approx(means.mean())


def test_unbalanced_seeds_and_missing_values():
    df = pd.DataFrame(
        {"seed": [0, 0, 0, 1, 1, 2, 2, 2], "value": [1.0, 1.2, np.nan, 2.0, 2.4, 0.5, 0.7, 0.6]}
    )
    y = seed_matrix(df)
    assert y.shape == (3, 3) and np.isnan(y[0, 2]) and np.isnan(y[1, 2])
    c = decompose(df, n_boot=200)
    # pooled within: ((0.02) + (0.08) + (0.02)) / (7 - 3)
    assert c.within == pytest.approx((0.02 + 0.08 + 0.02) / 4)
    assert c.runs == 7 and c.lo["within"] <= c.within <= c.hi["within"]


def test_identical_repeats_give_exactly_zero_within():
    """determinism=on: a seed's repeats are the same number, so the repeat part and its interval are 0."""
    rng = np.random.default_rng(3)
    seeds = rng.normal(0.6, 0.05, 8)
    df = pd.DataFrame([{"seed": i, "value": v} for i, v in enumerate(seeds) for _ in range(3)])
    c = decompose(df, n_boot=500)
    assert c.within == 0.0 and c.interval("within") == (0.0, 0.0)
    assert c.between == pytest.approx(seeds.var(ddof=1)) and c.between > 0
    assert c.ratio == 0.0


def test_bootstrap_mean_squares_are_unbiased():
    """The shrinkage: plain two-stage resampling would give E*[within] = (n-1)/n of the observed (2/3 here)."""
    rng = np.random.default_rng(11)
    y = seed_matrix(synthetic(12, 3, 0.5, 0.5, rng))
    _, between, within = anova(y)
    _, b_between, b_within = anova(bootstrap_draws(y, 4000, rng=5))
    assert b_within.mean() == pytest.approx(within, rel=0.05)
    assert b_between.mean() == pytest.approx(between, rel=0.15)


def test_one_run_per_seed_has_no_within_part():
    df = pd.DataFrame({"seed": range(6), "value": [0.1, 0.4, 0.2, 0.5, 0.3, 0.35]})
    c = decompose(df, n_boot=200)
    assert np.isnan(c.within) and c.between == pytest.approx(df.value.var(ddof=1))


def test_seeds_needed_matches_the_t_test_tables():
    # two-sample t-test, d = 1, alpha 0.05 two-sided, 80% power: 17 a group (Cohen 1988, table 2.4.1)
    assert seeds_needed(1.0, 1.0) == 17
    assert power(17, 1.0, 1.0) >= 0.8 > power(16, 1.0, 1.0)
    # d = 0.5: 64 a group
    assert seeds_needed(4.0, 1.0) == 64
    assert seeds_needed(0.0, 0.1) == 2
    assert seeds_needed(0.02, 0.05) > seeds_needed(0.01, 0.05)
    with pytest.raises(ValueError, match="delta"):
        seeds_needed(1.0, 0.0)


def test_the_variance_preset_composes_to_its_grid():
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=variance"], return_hydra_config=True)
    grid = {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert grid == {
        "seed": ["0", "1", "2", "3", "4"],
        "model": ["qwen3", "qwen3_moe"],
        "determinism": ["on", "off"],
        "repeat": ["0", "1", "2"],
    }
    assert cfg.eval.every > 0 and cfg.data.eval_fraction > 0 and cfg.steps == 20
