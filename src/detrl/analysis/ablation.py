"""The source ablation (`make ablation`, conf/ablation/): which source of nondeterminism makes repeats diverge,
at which step and stage, and how far it moves the reward curve.

A cell is `ablation=<name>` (x model): `all_on` / `all_off` (the presets), `no_<source>` (on with that source
alone released: leave-one-out) and `only_<source>` (off with that source alone pinned: leave-one-in); the cut is
ablated under partial rollout against `all_on_partial` / `all_off_partial`. A leave-two-out cell `no_<a>_and_<b>` (on
with a and b released) is read against `no_<a>`: it names b as a source that breaks repeats only together with a
(the schedule, `routing`, changes bits only with the default kernels: `no_kernels_and_routing`). Per cell:
- whether its repeats are bitwise identical, else where they first part (step, stage), from the fingerprints;
- for a leave-one-out cell, where its first repeat first differs from all-on's (a released source can change
  the bits yet stay reproducible: e.g. the engine's seeded streams instead of per-sample seeds);
- the reward spread: per step, the standard deviation of the reward across repeats (exactly 0 when they are
  identical), averaged over steps, with a 95% bootstrap interval over steps;
- the reward drift from all-on: per step, |mean reward of the cell - all-on's|, averaged over steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from detrl.analysis.findings import common_settings, parse_cell, without
from detrl.analysis.load import Sweep
from detrl.analysis.verdicts import STAGE, first_divergence, verdicts

REWARD = "critic/score/mean"
BOOTSTRAP = 1000


def _yes(reproducible) -> bool:
    """True (repeats bitwise identical); None (fewer than 2 complete repeats) counts as neither yes nor no."""
    return reproducible is not None and bool(reproducible)


def _no(reproducible) -> bool:
    return reproducible is not None and not bool(reproducible)


def kind_of(ablation: str) -> tuple[str, str | None]:
    """'no_kernels' -> ('leave-one-out', 'kernels'); 'no_kernels_and_routing' -> ('leave-two-out', 'routing');
    'all_on_partial' -> ('reference', None)."""
    if ablation.startswith("no_") and "_and_" in ablation:
        return "leave-two-out", ablation.split("_and_", 1)[1]
    for prefix, kind in (("no_", "leave-one-out"), ("only_", "leave-one-in")):
        if ablation.startswith(prefix):
            return kind, ablation[len(prefix) :]
    return "reference", None


def reference_of(ablation: str) -> str:
    """The cell an ablation cell is read against: all-on (the partial-rollout one for the cut); for a
    leave-two-out cell `no_<a>_and_<b>`, `no_<a>` (a alone released)."""
    if kind_of(ablation)[0] == "leave-two-out":
        return ablation.split("_and_", 1)[0]
    partial = ablation.endswith("_partial") or ablation in ("no_cut", "only_cut")
    return "all_on_partial" if partial else "all_on"


def _interval(x: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean of x (resampling its entries; (0, 0) when all are 0)."""
    if not len(x) or not np.any(x):
        return 0.0, 0.0
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(BOOTSTRAP, len(x)), replace=True).mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


COLUMNS = [
    "setting",
    "ablation",
    "kind",
    "source",
    "reference",
    "repeats",
    "reproducible",
    "first_divergence_step",
    "first_divergence_stage",
    "differs_from_all_on",
    "reward_spread",
    "reward_spread_lo",
    "reward_spread_hi",
    "reward_drift",
    "reward_last",
    "param_distance_last",
    "mismatch_max",
]  # the ablation table's columns, in order


def ablation_table(sweep: Sweep) -> pd.DataFrame:
    """One row per (setting, ablation cell); empty when the sweep has no `ablation=` cells."""
    cols = COLUMNS
    runs = sweep.runs[sweep.runs.status == "complete"]
    cells = [c for c in runs.cell.unique() if "ablation" in parse_cell(c)]
    if not cells:
        return pd.DataFrame(columns=cols)
    v = verdicts(sweep).set_index("cell")
    m = sweep.metrics[sweep.metrics.run.isin(runs.run)]
    per_step = m.groupby(["cell", "step"])[REWARD].agg(["mean", "std"]).reset_index() if REWARD in m else None
    first_run = runs.sort_values("repeat").groupby("cell").run.first()
    out = []
    common = common_settings(sweep.runs.cell.unique())  # e.g. steps=2 on every run: not a setting
    for cell in cells:
        setting, name = without(cell, "ablation", *common), parse_cell(cell)["ablation"]
        kind, source = kind_of(name)
        ref = ",".join(
            sorted(
                [
                    *(f"{k}={x}" for k, x in parse_cell(cell).items() if k != "ablation"),
                    f"ablation={reference_of(name)}",
                ]
            )
        )
        row = {
            "setting": setting,
            "ablation": name,
            "kind": kind,
            "source": source,
            "reference": reference_of(name) if kind != "reference" else None,
            "repeats": v.repeats[cell],
            "reproducible": v.distinct_trajectories[cell] == 1 if v.repeats[cell] >= 2 else None,
            "first_divergence_step": v.first_divergence_step[cell],
            "first_divergence_stage": v.first_divergence_stage[cell],
            "reward_last": v.reward_last[cell],
            "param_distance_last": v.param_distance_last[cell],
            "mismatch_max": v.mismatch_max[cell],
            "differs_from_all_on": None,
        }
        if kind == "leave-one-out" and ref in first_run and cell != ref:
            d = first_divergence(sweep.rows[first_run[cell]], sweep.rows[first_run[ref]])
            row["differs_from_all_on"] = f"step {d[0]}, {STAGE[d[1]]}" if d else "no: bitwise equal"
        if per_step is not None:
            g = per_step[per_step.cell == cell].sort_values("step")
            std = g["std"].fillna(0.0).to_numpy()
            row["reward_spread"] = float(std.mean()) if len(std) else None
            row["reward_spread_lo"], row["reward_spread_hi"] = _interval(std)
            r = per_step[per_step.cell == ref].set_index("step")["mean"]
            both = g.set_index("step")["mean"].align(r, join="inner")
            row["reward_drift"] = float((both[0] - both[1]).abs().mean()) if len(r) else None
        out.append(row)
    order = {"reference": 0, "leave-one-out": 1, "leave-two-out": 2, "leave-one-in": 3}
    df = pd.DataFrame(out, columns=cols)
    df["_k"] = df.kind.map(order)
    return df.sort_values(["setting", "_k", "ablation"]).drop(columns="_k").reset_index(drop=True)


def _all_off_distance(t: pd.DataFrame) -> float:
    off = t[t.ablation == "all_off"].param_distance_last
    return float(off.iloc[0]) if len(off) and off.notna().all() else float("nan")


def _judged(t: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The cells of `kind` with a verdict (two complete repeats or more)."""
    sel = t[t.kind == kind]
    return sel[sel.reproducible.map(lambda r: r is not None).astype(bool)]


def _sources(t: pd.DataFrame, verdict) -> list[str]:
    return sorted(set(t[t.reproducible.map(verdict).astype(bool)].source))


def _clauses(loo: pd.DataFrame, loi: pd.DataFrame) -> tuple[str | None, str | None]:
    """ "released alone from on, ... breaks ..." / "pinned alone in off, ... restores ...", each only where such
    cells ran with two repeats or more (None otherwise: nothing was measured to say it of)."""
    released = pinned = None
    if len(loo):
        b = _sources(loo, _no)
        released = f"{', '.join(b)} {'breaks' if len(b) == 1 else 'break'} bitwise repeats" if b else None
        released = released or f"{_names(loo, 'keeps', 'keep')} repeats bitwise identical"
    if len(loi):
        r = _sources(loi, _yes)
        pinned = f"{', '.join(r)} {'restores' if len(r) == 1 else 'restore'} bitwise repeats" if r else None
        pinned = pinned or f"none of {', '.join(sorted(set(loi.source)))} restores bitwise repeats"
    return released, pinned


def _on_top(t: pd.DataFrame) -> list[tuple[str, str]]:
    """Per leave-two-out cell of one setting with a verdict: (its reference's name and the source it names,
    the sentence). The second source is named as the cause only where the first alone keeps repeats bitwise
    identical and both together do not."""
    base = dict(zip(t.ablation, t.reproducible))
    out = []
    for r in _judged(t, "leave-two-out").itertuples():
        ref = base.get(r.reference)
        if ref is None:
            said = f"{r.ablation} names no source: {r.reference} has no 2 complete repeats to read it against"
        elif not ref:
            said = f"{r.ablation} names no source: {r.reference} alone already diverges"
        elif r.reproducible:
            said = f"released on top of {r.reference}, {r.source} keeps repeats bitwise identical"
        else:
            where = f"step {int(r.first_divergence_step)}, {r.first_divergence_stage}"
            said = (
                f"released on top of {r.reference} (bitwise repeats), {r.source} makes repeats diverge "
                f"({where}): {r.source} is the source"
            )
            out.append((f"on top of {r.reference}, {r.source} breaks bitwise repeats", said))
            continue
        out.append(("", said))
    return out


def _names(t: pd.DataFrame, one: str, many: str) -> str:
    """ "sampling keeps" / "sampling, routing keep": the sources of the cells that ran, with the verb."""
    names = sorted(set(t.source))
    return f"{', '.join(names)} {one if len(names) == 1 else many}"


def ablation_title(table: pd.DataFrame) -> str:
    """One line over all settings: which sources alone break bitwise repeats from on, which alone restore them
    from off; said only of the cells the sweep ran (with two complete repeats or more)."""
    released, pinned = _clauses(_judged(table, "leave-one-out"), _judged(table, "leave-one-in"))
    parts = [f"released alone from on, {released}" if released else None]
    parts.append(f"pinned alone in off, {pinned}" if pinned else None)
    pairs = {c for _, g in table.groupby("setting") for c, _ in _on_top(g) if c}
    parts += sorted(pairs)
    said = "; ".join(p for p in parts if p)
    if not said:
        return "Source ablation: no ablated cell has 2 complete repeats yet, so no verdict (reward std across repeats)"
    return said[:1].upper() + said[1:] + " (reward std across repeats, mean over steps)"


def _ci(lo: float, hi: float) -> str:
    return f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}-{hi:.3g}"


def _mask(t: pd.DataFrame, verdict) -> pd.Series:
    """A boolean mask (also on an empty table, where an object Series would select columns instead)."""
    return t.reproducible.map(verdict).astype(bool)


def ablation_findings(table: pd.DataFrame) -> list[str]:
    """Sentences computed from the table: per setting, which sources released alone break reproducibility and
    which change the bits while staying reproducible, and which pinned alone restore it; each said only of
    cells that ran with two complete repeats or more."""
    out = []
    for setting, t in table.groupby("setting", sort=True):
        loo, loi = _judged(t, "leave-one-out"), _judged(t, "leave-one-in")
        breaks = [
            f"{r.source} (step {int(r.first_divergence_step)}, {r.first_divergence_stage})"
            for r in loo[_mask(loo, _no)].itertuples()
        ]
        same = loo[_mask(loo, _yes) & loo.differs_from_all_on.map(lambda d: isinstance(d, str)).astype(bool)]
        equal = same.differs_from_all_on.str.startswith("no")
        parts = []
        if len(loo):
            parts.append(
                "released alone from `on`, "
                + (
                    ", ".join(breaks) + " make repeats diverge"
                    if breaks
                    else _names(loo, "keeps", "keep") + " repeats bitwise identical"
                )
            )
        if (~equal).any():
            parts.append(", ".join(same[~equal].source) + " change the bits but stay reproducible")
        if equal.any():
            parts.append(", ".join(same[equal].source) + " leave them bitwise equal to all-on")
        parts += [said for _, said in _on_top(t)]
        if len(loi):
            restores = list(loi[_mask(loi, _yes)].source)
            parts.append(
                "pinned alone in `off`, "
                + (
                    ", ".join(restores) + " restore bitwise repeats"
                    if restores
                    else f"none of {', '.join(sorted(set(loi.source)))} restores bitwise repeats"
                )
            )
        unjudged = sorted(set(t.ablation) - set(t[_mask(t, lambda r: r is not None)].ablation))
        if unjudged:
            parts.append(f"{', '.join(unjudged)}: fewer than 2 complete repeats, no verdict")
        near = loi[_mask(loi, _no) & loi.param_distance_last.notna()].sort_values("param_distance_last")
        if len(near):
            r = near.iloc[0]
            parts.append(
                f"{r.source} comes closest (repeats part first in {r.first_divergence_stage} and end "
                f"{r.param_distance_last:.2g} apart in parameter L2, all-off {_all_off_distance(t):.2g})"
            )
        spread = t[t.reward_spread.notna()].sort_values("reward_spread", ascending=False)
        if len(spread) and spread.reward_spread.iloc[0] > 0:
            top = spread.iloc[0]
            parts.append(
                f"the widest reward spread across repeats is {top.ablation} "
                f"({top.reward_spread:.3g}, 95% CI {_ci(top.reward_spread_lo, top.reward_spread_hi)})"
            )
        out.append(f"**{setting}**: " + "; ".join(parts) + ".")
    return out
