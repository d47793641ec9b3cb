"""Render a sweep's nondeterminism report: PNG figures and a markdown summary, without Jupyter.

    python -m detrl.report outputs/sweeps/determinism_matrix_<time>  [--out DIR]

The notebook `notebooks/nondeterminism_report.ipynb` calls the same functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from detrl.analysis import Sweep, divergence_matrix, load_sweep, spread, verdicts  # noqa: E402

VERDICT_COLUMNS = ["cell", "repeats", "distinct_trajectories", "first_divergence_step", "first_divergence_fp",
                   "reward_last", "step_time_s", "mismatch_max", "verdict"]


def markdown_table(df: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "-" if v != v else f"{v:.3g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def fig_divergence(sweep: Sweep):
    mat = divergence_matrix(sweep)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * mat.shape[1] + 4), 0.45 * len(mat) + 1.6))
    im = ax.imshow(mat.values, aspect="auto", cmap="Reds", vmin=1, vmax=max(2, int(mat.values.max())))
    ax.set_yticks(range(len(mat)), mat.index, fontsize=7)
    ax.set_xticks(range(mat.shape[1]), mat.columns, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("distinct trajectories across repeats (1 = bitwise identical)")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return fig


def _curves(sweep: Sweep, metric: str, title: str, ylog: bool = False):
    s = spread(sweep, metric)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    det = sweep.runs.drop_duplicates("cell").set_index("cell").determinism
    # on and off of the same setting share a colour; solid = on, dashed = off
    base = {c: ",".join(p for p in c.split(",") if not p.startswith("determinism=")) or "default" for c in det.index}
    colors = {b: f"C{i}" for i, b in enumerate(sorted(set(base.values())))}
    for cell, g in s.groupby("cell"):
        style = "-" if det.get(cell) == "on" else "--"
        color = colors[base[cell]]
        ax.plot(g.step, g["mean"], style, color=color, label=cell, lw=1.2)
        ax.fill_between(g.step, g["min"], g["max"], color=color, alpha=0.12)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ylog:
        ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    return fig


def fig_reward(sweep: Sweep):
    return _curves(sweep, "critic/score/mean", "reward: mean and min-max band over repeats (solid = on, dashed = off)")


def fig_mismatch(sweep: Sweep):
    return _curves(sweep, "mismatch/train_rollout_logprob_abs_diff_max",
                   "max |logp_trainer - logp_rollout| over response tokens (0 = true on-policy)", ylog=True)


def fig_timing(sweep: Sweep):
    v = verdicts(sweep)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(v) + 1.5))
    colors = ["tab:blue" if d == "on" else "tab:orange" for d in v.determinism]
    ax.barh(v.cell, v.step_time_s, color=colors)
    ax.set_xlabel("median step time (s)")
    ax.set_title("time cost of determinism (blue = on, orange = off)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig


FIGURES = {"divergence": fig_divergence, "reward": fig_reward, "mismatch": fig_mismatch, "timing": fig_timing}


def render(sweep_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write <out>/{divergence,reward,mismatch,timing}.png and <out>/summary.md; returns out."""
    sweep = load_sweep(sweep_dir)
    out = Path(out) if out else Path(sweep_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIGURES.items():
        fig = make(sweep)
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    v = verdicts(sweep)
    incomplete = sweep.runs[sweep.runs.status != "complete"]
    md = [f"# Nondeterminism report: `{Path(sweep_dir).name}`", "",
          f"{len(sweep.runs)} runs in {v.shape[0]} cells; {len(incomplete)} incomplete.", "",
          markdown_table(v[VERDICT_COLUMNS]), ""]
    if len(incomplete):
        md += ["Incomplete runs: " + ", ".join(f"`{r}` ({n} steps)" for r, n in
                                              zip(incomplete.run, incomplete.steps_logged)), ""]
    md += [f"![{name}]({name}.png)" for name in FIGURES]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m detrl.report", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--out", default=None, help="output dir (default: SWEEP_DIR/report)")
    args = ap.parse_args(argv)
    try:
        out = render(args.sweep_dir, args.out)
    except FileNotFoundError as e:
        print(f"detrl.report: {e}", file=sys.stderr)
        sys.exit(2)
    print((out / "summary.md").read_text())
    print(f"figures and summary in {out}")


if __name__ == "__main__":
    main()
