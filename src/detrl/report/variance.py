"""The report's "Variance" section and its figure `variance.png`: how much of the spread between runs is the
seed's and how much nondeterministic repeats of one seed add (`detrl.analysis.variance`).

`write(sweep, out)` appends the section to `out/summary.md` and saves `out/variance.png`; a sweep without two
seeds of some config has nothing to decompose and gets neither. Colours as in `detrl.report`: on = blue,
off = orange; between-seed solid, within-seed (repeat) dashed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from detrl.analysis.variance import (  # noqa: E402
    Components,
    added_share,
    decompose,
    decompose_steps,
    run_values,
    seeds_needed,
    step_values,
)

COLOR = {"on": "tab:blue", "off": "tab:orange"}
# label -> (metric, window): the final reward = mean of the last `window` steps; eval = the last eval
SUMMARIES = {
    "final reward": ("critic/score/mean", 5),
    "eval accuracy": ("eval/accuracy", 1),
}
DELTA = 0.05  # the difference the power line asks about, in the metric's units (reward / accuracy)


def _mode(config: str) -> str | None:
    for part in config.split(","):
        if part.startswith("determinism="):
            return part.split("=", 1)[1]
    return None


def _panel(config: str) -> str:
    return ",".join(p for p in config.split(",") if not p.startswith("determinism=")) or "default"


def _ci(c: Components, name: str, fmt: str = "{:.2g}") -> str:
    v, (lo, hi) = getattr(c, name), c.interval(name)
    if np.isnan(v):
        return "-"
    return f"{fmt.format(v)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def summary_components(sweep, window: int = 5, n_boot: int = 2000) -> dict[tuple[str, str], Components]:
    """(summary label, config) -> Components, for every config with at least two seeds."""
    out = {}
    for label, (metric, w) in SUMMARIES.items():
        if metric not in sweep.metrics.columns:
            continue
        vals = run_values(sweep, metric, window if w > 1 else 1)
        for config, g in vals.groupby("config", sort=True):
            if g.seed.nunique() >= 2:
                out[label, config] = decompose(g, n_boot=n_boot)
    return out


def _table(comps: dict[tuple[str, str], Components], delta: float) -> list[str]:
    head = (
        "| summary | config | seeds | runs | mean | between-seed var [95%] | within-seed var [95%] | "
        f"within / between [95%] | seeds for a {delta:g} difference (80% power) |"
    )
    lines = [head, "|" + "---|" * 9]
    for (label, config), c in comps.items():
        need = seeds_needed(c.total, delta) if c.total > 0 else 2
        lines.append(
            f"| {label} | {config} | {c.seeds} | {c.runs} | {c.mean:.3f} | {_ci(c, 'between')} | "
            f"{_ci(c, 'within')} | {_ci(c, 'ratio', '{:.0%}')} | {need} |"
        )
    return lines


def findings(comps: dict[tuple[str, str], Components], delta: float = DELTA) -> list[str]:
    """One sentence per (summary, on/off pair of configs): the repeat variance `off` adds as a share of the seed
    variance (measured under `on`, where it is alone), and the power line under each."""
    out = []
    for (label, config), off in comps.items():
        on = comps.get((label, config.replace("determinism=off", "determinism=on")))
        if _mode(config) != "off" or on is None:
            continue
        est, lo, hi = added_share(off.values, on.values)
        share = (
            f"an off repeat adds {est:.0%} [{lo:.0%}, {hi:.0%}] of the seed variance"
            if not np.isnan(est)
            else "the seed variance under on is 0 (no share)"
        )
        n_on = seeds_needed(on.total, delta) if on.total > 0 else 2
        n_off = seeds_needed(off.total, delta) if off.total > 0 else 2
        out.append(
            f"{_panel(config)}, {label}: {share} (repeat sd {np.sqrt(off.within):.3f} vs seed sd "
            f"{np.sqrt(on.between):.3f}); a {delta:g} difference at 80% power takes {n_on} seeds a config under "
            f"on, {n_off} under off."
        )
    return out


def markdown(sweep, window: int = 5, delta: float = DELTA, comps=None) -> list[str]:
    """The "Variance" section's lines ([] when no config has two seeds)."""
    comps = summary_components(sweep, window) if comps is None else comps
    if not comps:
        return []
    return [
        "## Variance",
        "",
        " ".join(findings(comps, delta)),
        "",
        f"Per config (the cell without its seed): final reward = mean `critic/score/mean` of the last {window} "
        "steps, eval accuracy = the last `eval/accuracy`. Between-seed and within-seed (repeat) variance from a "
        'one-way random-effects ANOVA ("an off repeat adds" = within-seed variance under off / between-seed '
        "variance under on); 95% percentile intervals from a hierarchical bootstrap (seeds, then "
        "repeats within them; 2000 draws). At 5 seeds the between-seed interval undercovers (79% for a nominal "
        "95% in simulation). Seeds needed: a two-sided t-test, one run a seed, per-run variance = between + "
        "within.",
        "",
        *_table(comps, delta),
        "",
        "![variance components per step](variance.png)",
        "",
    ]


MISMATCH = (
    "mismatch/train_rollout_logprob_abs_diff",
    "mismatch/train_rollout_logprob_abs_diff_max",
    "mismatch/k3_kl",
    "mismatch/router_agreement",
)


def dtype_markdown(sweep) -> list[str]:
    """Trainer/engine mismatch per compute dtype, side by side (a sweep over `model.dtype`; [] otherwise):
    the mean over steps and runs of each `mismatch/*`, per cell without its dtype."""
    m = sweep.metrics
    cells = m.cell.str.extract(r"model\.dtype=(\w+)")[0]
    if cells.nunique() < 2:
        return []
    keys = [k for k in MISMATCH if k in m.columns]
    df = m.assign(dtype=cells, panel=m.cell.str.replace(r",?model\.dtype=\w+", "", regex=True).str.strip(","))
    table = df.groupby(["panel", "dtype"])[keys].mean().reset_index()
    head = "| cell | model.dtype | " + " | ".join(k.removeprefix("mismatch/") for k in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for r in table.itertuples(index=False):
        vals = " | ".join("-" if pd.isna(v) else f"{v:.3g}" for v in r[2:])
        lines.append(f"| {r.panel} | {r.dtype} | {vals} |")
    return [
        "## Compute dtype: trainer vs engine",
        "",
        "Mean over steps and runs of the trainer/engine mismatch (the trainer's old logprobs against the "
        "engine's on the tokens the current weights sampled); the engine computes in the trainer's dtype.",
        "",
        *lines,
        "",
    ]


def fig_variance(sweep, n_boot: int = 300):
    """Per step, one column per config pair (model ...), one row per metric: the between-seed and within-seed
    standard deviations (square roots of the components) with their bootstrap bands."""
    rows = [(label, m) for label, (m, _) in SUMMARIES.items() if m in sweep.metrics.columns]
    per = {label: step_values(sweep, m).dropna(subset=["value"]) for label, m in rows}
    panels = sorted({_panel(c) for df in per.values() for c in df.config.unique()})
    fig, axes = plt.subplots(
        len(rows), len(panels), figsize=(4.2 * len(panels), 3.0 * len(rows) + 1.0), squeeze=False
    )
    for i, (label, metric) in enumerate(rows):
        for j, panel in enumerate(panels):
            ax = axes[i, j]
            for config, g in per[label].groupby("config"):
                if _panel(config) != panel or g.seed.nunique() < 2:
                    continue
                _draw(ax, decompose_steps(g, n_boot=n_boot), COLOR.get(_mode(config), "grey"))
            ax.set_title(f"{panel}: {metric}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("standard deviation across runs")
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, label=f"determinism={m}") for m, c in COLOR.items()]
    handles += [
        plt.Line2D([], [], color="grey", ls="-", label="between seeds"),
        plt.Line2D([], [], color="grey", ls="--", label="within a seed (repeats)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Seed vs repeat spread per step (95% bootstrap bands)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    return fig


def _draw(ax, steps: pd.DataFrame, color: str) -> None:
    if steps.empty:
        return
    for part, ls in (("between", "-"), ("within", "--")):
        sd = np.sqrt(steps[part].clip(lower=0))
        ax.plot(steps.step, sd, color=color, ls=ls, marker="." if len(steps) < 6 else None)
        lo, hi = np.sqrt(steps[f"{part}_lo"].clip(lower=0)), np.sqrt(steps[f"{part}_hi"].clip(lower=0))
        ax.fill_between(steps.step, lo, hi, color=color, alpha=0.12 if ls == "-" else 0.06, lw=0)


def write(sweep, out: str | Path, window: int = 5, delta: float = DELTA) -> bool:
    """Append the "Variance" section to out/summary.md and save out/variance.png (where a config has two seeds),
    and the compute-dtype mismatch table (a sweep over `model.dtype`); False when neither applies."""
    out = Path(out)
    lines = markdown(sweep, window, delta)
    if lines:
        fig = fig_variance(sweep)
        fig.savefig(out / "variance.png", dpi=110)
        plt.close(fig)
    lines += dtype_markdown(sweep)
    if not lines:
        return False
    summary = out / "summary.md"
    text = summary.read_text() if summary.is_file() else ""
    summary.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))
    return True
