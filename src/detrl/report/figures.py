"""The report's figures: one function per figure, each with one idea; `FIGURES` lists them in reading order.

Colours: determinism on = blue, off = orange, everywhere; line style: partial rollout off = solid, on = dashed.
Panels: one per setting other than determinism and partial. Titles state what the data say
(`detrl.analysis.findings`).
"""

from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from detrl.analysis import (  # noqa: E402
    Sweep,
    distances,
    spread,
    verdicts,
)
from detrl.analysis.ablation import ablation_table, ablation_title  # noqa: E402
from detrl.analysis.findings import (  # noqa: E402
    common_settings,
    distance_sentence,
    divergence_sentence,
    facts,
    parse_cell,
    reward_sentence,
    time_sentence,
    without,
)

COLOR = {"on": "tab:blue", "off": "tab:orange"}
STYLE = {"off": "-", "on": "--", None: "-"}  # partial rollout

# ---------------------------------------------------------------- layout helpers


def _det(cell: str) -> str | None:
    return parse_cell(cell).get("determinism")


def _partial(cell: str) -> str | None:
    return parse_cell(cell).get("partial")


def _label(sweep: Sweep, cell: str, *keys: str) -> str:
    """The cell's settings minus `keys` and minus those every run of the sweep shares (e.g. `steps=3`)."""
    return without(cell, *keys, *common_settings(sweep.runs.cell.unique()))


def _grid(sweep: Sweep, cells=None, width: float = 4.2, height: float = 3.0):
    """One subplot per panel (shared axes): the cell's settings but determinism and partial; -> (fig,
    {panel: ax}, {cell: ax})."""
    cells = sorted(sweep.runs.cell.unique()) if cells is None else cells
    panel_of = {c: _label(sweep, c, "determinism", "partial") for c in cells}
    panels = sorted(set(panel_of.values()))
    ncol = min(2, len(panels)) or 1
    nrow = max(1, math.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(
        nrow,
        ncol,
        figsize=(max(width * ncol, 7.0), height * nrow + 1.2),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    by_panel = dict(zip(panels, axes.flat))
    return fig, by_panel, {c: by_panel[p] for c, p in panel_of.items()}


def _legend(fig, partial: bool, modes: tuple[str, ...] = ("on", "off")) -> None:
    handles = [plt.Line2D([], [], color=COLOR[m], label=f"determinism={m}") for m in modes]
    if partial:
        handles += [
            plt.Line2D([], [], color="grey", ls=STYLE[p], label=f"partial={p}") for p in ("off", "on")
        ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def _wrap(title: str, width: int) -> str:
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def _style_step_panel(ax, panel: str, ylabel: str, grid: str = "major") -> None:
    """A small-multiple panel over steps: its title, integer step ticks, the y label on the first column."""
    ax.set_title(panel, fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    if ax.get_subplotspec().is_first_col():
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which=grid)


def _finish(fig, title: str) -> None:
    width = int(fig.get_figwidth() * 12)  # characters per line at fontsize 10
    fig.suptitle(_wrap(title, width), fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))


def _empty(title: str, text: str):
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    _finish(fig, title)
    return fig


# ---------------------------------------------------------------- figures


def fig_param_distance(sweep: Sweep):
    """(1) Parameter L2 distance between repeats vs step, per cell: median line, min-max band; log y, with
    distances that are exactly 0 drawn on a floor line labelled so."""
    dist = distances(sweep, "param")
    title = distance_sentence(facts(sweep))
    if dist.empty:
        return _empty(title, "no drift.jsonl in these runs")
    positive = dist[["min", "median", "max"]].to_numpy()
    positive = positive[positive > 0]
    floor = 10 ** (math.floor(math.log10(positive.min())) - 1) if positive.size else 1e-8
    fig, axes, ax_of = _grid(sweep, sorted(dist.cell.unique()))
    for cell, g in dist.groupby("cell"):
        ax, color, ls = ax_of[cell], COLOR.get(_det(cell), "grey"), STYLE.get(_partial(cell), "-")
        med = g["median"].where(g["median"] > 0, floor)
        ax.plot(g.step, med, ls, color=color, lw=1.3)
        ax.fill_between(
            g.step, g["min"].clip(lower=floor), g["max"].clip(lower=floor), color=color, alpha=0.15
        )
        zero = g[g["max"] == 0]
        ax.plot(zero.step, [floor] * len(zero), "o", ms=3, color=color, mfc="white" if ls == "--" else color)
    for panel, ax in axes.items():
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, None)
        ticks = [t for t in ax.get_yticks() if t > floor * 1.01]
        ax.set_yticks([floor, *ticks], ["exactly 0", *[f"1e{round(math.log10(t))}" for t in ticks]])
        ax.set_ylim(floor / 3, max(positive.max() * 3, floor * 10) if positive.size else floor * 10)
        _style_step_panel(ax, panel, "‖θ_a − θ_b‖₂ between repeats")
    _legend(fig, any(_partial(c) for c in dist.cell))
    _finish(fig, title)
    return fig


def fig_reward(sweep: Sweep):
    """(2) Reward mean with the min-max band across repeats, one panel per setting, on vs off overlaid."""
    s = spread(sweep, "critic/score/mean")
    f = facts(sweep)
    if s.empty:
        return _empty("reward", "no complete runs")
    title = (
        reward_sentence(f).replace("; determinism=on changes", ".\ndeterminism=on changes").split("\n")[0]
        if f.get("reward_gap_max") is not None
        else "Reward per step (mean and min-max over repeats)"
    )
    fig, axes, ax_of = _grid(sweep, sorted(s.cell.unique()))
    for cell, g in s.groupby("cell"):
        ax, color, ls = ax_of[cell], COLOR.get(_det(cell), "grey"), STYLE.get(_partial(cell), "-")
        ax.plot(g.step, g["mean"], ls, color=color, lw=1.2)
        ax.fill_between(g.step, g["min"], g["max"], color=color, alpha=0.12)
    for panel, ax in axes.items():
        _style_step_panel(ax, panel, "reward (fraction exact)")
    _legend(fig, any(_partial(c) for c in s.cell))
    _finish(fig, title)
    return fig


def fig_verdicts(sweep: Sweep):
    """(3) The verdict table as a figure: per cell, how many steps its repeats stay bitwise identical, and
    the step and first stage where they part."""
    v = verdicts(sweep).sort_values(["determinism", "cell"], ascending=[False, True]).reset_index(drop=True)
    steps = sweep.runs.set_index("cell").steps_expected.groupby(level=0).max()
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(v) + 1.6))
    for i, r in v.iterrows():
        total = int(steps.get(r.cell) or sweep.runs.steps_logged.max() or 0)
        same = (
            int(r.first_divergence_step) - 1
            if r.first_divergence_step == r.first_divergence_step and r.first_divergence_step is not None
            else total
        )
        color = COLOR.get(r.determinism, "grey")
        ax.barh(i, same, color=color, alpha=0.85, height=0.6)
        if r.verdict == "bitwise identical":
            text = f"identical at all {total} steps"
        elif r.first_divergence_step is None or r.first_divergence_step != r.first_divergence_step:
            text = r.verdict
        else:
            extra = r.stages_differing_then.split("+")[1:] if isinstance(r.stages_differing_then, str) else []
            text = f"step {int(r.first_divergence_step)}: {r.first_divergence_stage}" + (
                f" (then also {', '.join(extra)})" if extra else ""
            )
        ax.text(same + 0.3, i, text, va="center", fontsize=7)
    ax.set_yticks(
        range(len(v)),
        [_label(sweep, c, "determinism") + f"  [{d}]" for c, d in zip(v.cell, v.determinism)],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlim(0, max(int(steps.max() if len(steps) and steps.notna().any() else 1), 1) * 1.45)
    ax.set_xlabel("steps with every fingerprint equal across repeats")
    ax.grid(alpha=0.3, axis="x")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOR[m], label=f"determinism={m}") for m in ("on", "off")]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle(_wrap(divergence_sentence(facts(sweep)), 120), fontsize=9)
    fig.tight_layout()
    return fig


def fig_mismatch(sweep: Sweep):
    """(4) Trainer/rollout logprob mismatch over steps for the off cells (on cells are exactly 0)."""
    key = "mismatch/train_rollout_logprob_abs_diff_max"
    s = spread(sweep, key)
    f = facts(sweep)
    off_cells = sorted(c for c in s.cell.unique() if _det(c) != "on")
    on_max = f["on"]["mismatch_max"]
    if not off_cells:
        return _empty("trainer/rollout mismatch", "no determinism=off cells")
    title = (
        # the largest value drawn (also for cells with one repeat, which facts leave out)
        f"Off: trainer and rollout logprobs of the same tokens differ by up to "
        f"{s[s.cell.isin(off_cells)]['max'].max():.1e} nats"
        + (
            "; on: exactly 0 at every step (true on-policy)"
            if on_max == 0
            else f"; on: up to {on_max:.1e}"
            if on_max is not None
            else ""
        )
    )
    fig, axes, ax_of = _grid(sweep, off_cells)
    for cell in off_cells:
        g = s[s.cell == cell]
        ax, ls = ax_of[cell], STYLE.get(_partial(cell), "-")
        ax.plot(g.step, g["mean"], ls, color=COLOR["off"], lw=1.2)
        ax.fill_between(g.step, g["min"], g["max"], color=COLOR["off"], alpha=0.15)
    for panel, ax in axes.items():
        ax.set_yscale("log")
        _style_step_panel(ax, panel, "max |log p_train − log p_rollout| (nats)", grid="both")
    _legend(fig, any(_partial(c) for c in off_cells), modes=("off",))
    _finish(fig, title)
    return fig


def fig_cost(sweep: Sweep):
    """(5) Cost: median step time, on vs off side by side per setting, with the on/off ratio."""
    complete = sweep.runs[sweep.runs.status == "complete"].run
    m = sweep.metrics[sweep.metrics.run.isin(complete)] if len(sweep.metrics) else sweep.metrics
    if m.empty:
        return _empty("cost", "no complete runs")
    per_run = m.groupby(["cell", "run"])["timing_s/step"].median().reset_index()
    per_run["setting"] = per_run.cell.map(lambda c: _label(sweep, c, "determinism"))
    per_run["det"] = per_run.cell.map(_det)
    cell_time = per_run.groupby("cell")["timing_s/step"].median()  # = verdicts' step_time_s
    settings = sorted(per_run.setting.unique())
    f = facts(sweep)
    title = time_sentence(f) or "median step time"
    fig, ax = plt.subplots(figsize=(max(6.5, 1.25 * len(settings) + 2), 4.4))
    width = 0.38
    for i, setting in enumerate(settings):
        times = {}
        for j, mode in enumerate(("on", "off")):
            sel = per_run[(per_run.setting == setting) & (per_run.det == mode)]
            if not len(sel):
                continue
            x = i + (j - 0.5) * width
            times[mode] = cell_time[sel.cell.iloc[0]]
            ax.bar(x, times[mode], width, color=COLOR[mode], label=f"determinism={mode}" if i == 0 else None)
            ax.plot([x] * len(sel), sel["timing_s/step"], "k.", ms=3)
        if len(times) == 2:
            top = per_run[per_run.setting == setting]["timing_s/step"].max()
            ax.text(
                i,
                max(top, *times.values()) * 1.04,
                f"on/off {times['on'] / times['off']:.2f}x",
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(range(len(settings)), [s.replace(",", "\n") for s in settings], fontsize=7)
    ax.set_ylim(0, per_run["timing_s/step"].max() * 1.12)
    ax.set_ylabel("median step time per run (s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    # wrapped to the figure's width (~13 characters an inch at fontsize 9): a long title is not clipped
    ax.set_title(
        _wrap(title, int(fig.get_figwidth() * 13)) + "\n(bars: median over repeats; dots: each run)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def fig_ablation(sweep: Sweep):
    """(6, source-ablation sweeps) Per setting and ablation cell: the reward spread across repeats (mean over
    steps of the per-step standard deviation, 95% bootstrap interval), blue where the repeats are bitwise
    identical, orange where they diverge; the label says where they part and whether all-on's bits change."""
    t = ablation_table(sweep)
    if t.empty:
        return _empty("source ablation", "no ablation= cells in this sweep")
    settings = sorted(t.setting.unique())
    fig, axes = plt.subplots(
        1,
        len(settings),
        figsize=(6.2 * len(settings), 0.3 * t.groupby("setting").size().max() + 1.8),
        sharex=True,
        squeeze=False,
    )
    top = float(t.reward_spread_hi.max() or 0) or 1.0
    for ax, setting in zip(axes.flat, settings):
        g = t[t.setting == setting].reset_index(drop=True)
        for i, r in g.iterrows():
            color = "grey" if r.reproducible is None else COLOR["on"] if r.reproducible else COLOR["off"]
            ax.barh(i, r.reward_spread or 0, color=color, alpha=0.85, height=0.6)
            if not r.reward_spread:  # exactly 0: a mark on the axis
                ax.plot(0, i, "o", ms=4, color=color, clip_on=False)
            if r.reward_spread:
                ax.errorbar(
                    r.reward_spread,
                    i,
                    xerr=[[r.reward_spread - r.reward_spread_lo], [r.reward_spread_hi - r.reward_spread]],
                    fmt="none",
                    ecolor="black",
                    lw=0.8,
                    capsize=2,
                )
            if r.reproducible is None:
                text = "fewer than 2 complete repeats"
            else:
                text = (
                    "bitwise repeats"
                    if r.reproducible
                    else f"diverge at step {int(r.first_divergence_step)} ({r.first_divergence_stage})"
                )
            if isinstance(r.differs_from_all_on, str):
                text += (
                    "; = all-on"
                    if r.differs_from_all_on.startswith("no")
                    else f"; vs all-on: {r.differs_from_all_on}"
                )
            ax.text(max(r.reward_spread_hi or 0, 0) + top * 0.02, i, text, va="center", fontsize=7)
        ax.set_yticks(range(len(g)), g.ablation, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("reward std across repeats (mean over steps)")
        ax.set_xlim(0, top * 1.7)
        ax.grid(alpha=0.3, axis="x")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLOR["on"], label="repeats bitwise identical"),
        plt.Rectangle((0, 0), 1, 1, color=COLOR["off"], label="repeats diverge"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    _finish(fig, ablation_title(t))
    return fig


FIGURES = {
    "distance": fig_param_distance,
    "reward": fig_reward,
    "verdicts": fig_verdicts,
    "mismatch": fig_mismatch,
    "cost": fig_cost,
}
