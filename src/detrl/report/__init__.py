"""Render a sweep's nondeterminism report: PNG figures and a markdown summary, without Jupyter.

    python -m detrl.report outputs/sweeps/determinism_matrix_<time>  [--out DIR] [--wandb ENTITY/PROJECT/GROUP]

One function per figure, each with one idea; `FIGURES` lists them in reading order. The notebook
`notebooks/nondeterminism_report.ipynb` calls the same functions. Colours: determinism on = blue, off =
orange, everywhere; line style: partial rollout off = solid, on = dashed. Panels: one per setting other
than determinism and partial (model x algo in the determinism matrix). Titles state what the data say
(computed by `detrl.analysis.findings`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from detrl.analysis import (  # noqa: E402
    Sweep,
    findings,
    load_sweep,
    pair_divergences,
    verdicts,
)
from detrl.analysis.ablation import COLUMNS as ABLATION_TABLE_COLUMNS  # noqa: E402
from detrl.analysis.ablation import ablation_findings, ablation_table  # noqa: E402
from detrl.analysis.findings import (  # noqa: E402
    common_settings,
    hosts,
    parse_cell,
)
from detrl.report import variance as variance_report  # noqa: E402
from detrl.report.figures import (  # noqa: E402, F401  (the notebook and tests import them from here)
    FIGURES,
    fig_ablation,
    fig_cost,
    fig_mismatch,
    fig_param_distance,
    fig_reward,
    fig_verdicts,
)

VERDICT_COLUMNS = [
    "cell",
    "repeats",
    "distinct_trajectories",
    "first_divergence_step",
    "first_divergence_stage",
    "stages_differing_then",
    "param_distance_last",
    "reward_last",
    "step_time_s",
    "mismatch_max",
    "verdict",
]


def markdown_table(df: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "-" if v != v else f"{v:.3g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


# the ablation table as the summary shows it: one table per setting, the source named in the ablation cell
ABLATION_COLUMNS = [c for c in ABLATION_TABLE_COLUMNS if c not in ("setting", "source")]


def figures_for(sweep: Sweep) -> dict:
    """FIGURES; for a source-ablation sweep the verdicts and the ablation figure (its cells are not on/off pairs of
    one setting, which the other figures draw as panels)."""
    if any("ablation" in parse_cell(c) for c in sweep.runs.cell):
        return {"ablation": fig_ablation, "verdicts": fig_verdicts}
    return dict(FIGURES)


def ablation_markdown(sweep: Sweep) -> list[str]:
    """The section "which source causes divergence" (empty for a sweep without ablation cells)."""
    t = ablation_table(sweep)
    if t.empty:
        return []
    md = [
        "## Which source causes divergence, at which step, and how far the reward curves drift",
        "",
        " ".join(ablation_findings(t)),
        "",
        "Cells (conf/ablation/): `no_<source>` = determinism=on with that source alone released; `only_<source>` "
        "= determinism=off with it alone pinned; `no_<a>_and_<b>` = on with a and b released, read against "
        "`no_<a>` (b named as the source where a alone keeps repeats identical and both do not); the cut is "
        "read under partial rollout against `all_on_partial` / `all_off_partial`. `reward_spread` = the standard deviation of the reward across "
        "repeats at each step, averaged over steps (exactly 0 when the repeats are identical), with its 95% "
        "bootstrap interval over steps; `reward_drift` = the mean over steps of |cell mean reward - its `reference`'s| "
        "(all-on's unless named); "
        "`differs_from_all_on` = where a leave-one-out cell's first repeat first differs from all-on's.",
        "",
    ]
    for setting, g in t.groupby("setting", sort=True):
        md += [f"### {setting}", "", markdown_table(g[ABLATION_COLUMNS]), ""]
    return md + ["![ablation](ablation.png)", ""]


def runs_line(sweep: Sweep, v: pd.DataFrame) -> str:
    """ "4 runs in 2 cells (1 determinism=on, 1 off), 2 repeats each; 0 incomplete; every run: steps=3"."""
    n, cells = len(sweep.runs), len(v)
    modes = v.determinism.value_counts()
    out = f"{n} run{'s' * (n != 1)} in {cells} cell{'s' * (cells != 1)}"
    if set(modes.index) <= {"on", "off"} and len(modes):
        out += " (" + ", ".join(f"{modes[m]} determinism={m}" for m in ("on", "off") if m in modes) + ")"
    lo, hi = int(v.repeats.min()), int(v.repeats.max())
    out += f", {lo if lo == hi else f'{lo}-{hi}'} complete repeat{'s' * (hi != 1)} per cell"
    out += f"; {(sweep.runs.status != 'complete').sum()} incomplete"
    machines, _ = hosts(sweep.runs)
    out += f"; on {machines[0]}" if len(machines) == 1 else ""  # several: the findings name them
    common = common_settings(sweep.runs.cell.unique())
    return out + (f"; every run: {', '.join(f'{k}={x}' for k, x in common.items())}" if common else "")


def summary_markdown(sweep: Sweep, name: str) -> str:
    v = verdicts(sweep)
    incomplete = sweep.runs[sweep.runs.status != "complete"]
    md = [
        f"# Nondeterminism report: `{name}`",
        "",
        " ".join(findings(sweep)),
        "",
        f"{runs_line(sweep, v)}; source: {sweep.source}. "
        "First divergence = the first step where any two repeats differ, and the first differing stage there "
        "in pipeline order (order -> tokens -> logprobs -> params); `stages_differing_then` lists every stage "
        "that differs at that step. `param_distance_last` = median L2 distance between repeats' parameters at "
        "the last step (from the drift sketches; exactly 0 where fp/params is equal).",
        "",
        markdown_table(v[VERDICT_COLUMNS]),
        "",
    ]
    pairs = pair_divergences(sweep)
    if len(pairs):
        by = pairs.groupby("stages").param_distance.agg(["count", "min", "median", "max"]).reset_index()
        by = by.sort_values("median").rename(
            columns={
                "stages": "stages differing at the first divergence",
                "count": "pairs",
                "min": "distance min",
                "median": "distance median",
                "max": "distance max",
            }
        )
        md += [
            "Pairs of repeats by what differs at their first differing step, with their parameter L2 distance "
            "at that step (a difference in params alone = the trainer; order + params = a pure reordering; "
            "tokens = the engine sampled other tokens):",
            "",
            markdown_table(by),
            "",
        ]
    if len(incomplete):
        md += [
            "Incomplete runs: "
            + ", ".join(f"`{r}` ({n} steps)" for r, n in zip(incomplete.run, incomplete.steps_logged)),
            "",
        ]
    md += ablation_markdown(sweep)
    md += [f"![{n}]({n}.png)" for n in figures_for(sweep) if n != "ablation"]
    return "\n".join(md) + "\n"


def render(
    sweep_dir: str | Path | None, out: str | Path | None = None, wandb_path: str | None = None
) -> Path:
    """Write <out>/<figure>.png for each of FIGURES and <out>/summary.md; returns out."""
    sweep = load_sweep(sweep_dir, wandb_path=wandb_path)
    out = Path(out) if out else Path(sweep_dir or ".") / "report"
    out.mkdir(parents=True, exist_ok=True)
    for name, make in figures_for(sweep).items():
        fig = make(sweep)
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    (out / "summary.md").write_text(summary_markdown(sweep, Path(sweep_dir or wandb_path).name))
    variance_report.write(sweep, out)  # "Variance" section + variance.png, where a config has several seeds
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m detrl.report", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", nargs="?", default=None)
    ap.add_argument("--out", default=None, help="output dir (default: SWEEP_DIR/report)")
    ap.add_argument(
        "--wandb",
        default=None,
        metavar="ENTITY/PROJECT/GROUP",
        help="read the runs from W&B (falls back to SWEEP_DIR when W&B does not answer)",
    )
    args = ap.parse_args(argv)
    if not args.sweep_dir and not args.wandb:
        ap.error("give SWEEP_DIR, --wandb, or both")
    try:
        out = render(args.sweep_dir, args.out, args.wandb)
    except FileNotFoundError as e:
        print(f"detrl.report: {e}", file=sys.stderr)
        sys.exit(2)
    print((out / "summary.md").read_text())
    print(f"figures and summary in {out}")


if __name__ == "__main__":
    main()
