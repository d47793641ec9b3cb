"""The numbers a report's titles and opening sentences state, computed from a sweep (nothing hand-written)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from detrl.analysis.drift import distances
from detrl.analysis.load import Sweep
from detrl.analysis.verdicts import verdicts

REWARD_WINDOW = 5  # the reward "at the end" is the mean over each run's last 5 steps


def parse_cell(cell: str) -> dict[str, str]:
    """ "algo=dapo,determinism=off" -> {"algo": "dapo", "determinism": "off"} ("default" -> {})."""
    return dict(p.split("=", 1) for p in cell.split(",") if "=" in p)


def without(cell: str, *keys: str) -> str:
    """The cell's settings minus `keys`, as a label ("all" when nothing is left)."""
    return ",".join(f"{k}={v}" for k, v in sorted(parse_cell(cell).items()) if k not in keys) or "all"


# the keys a report lays out by (colour, line style, ablation rows): kept in labels even when one value
LAYOUT_KEYS = ("determinism", "partial", "ablation")


def common_settings(cells) -> dict[str, str]:
    """The settings every cell shares (overrides outside the sweep's grid, e.g. `steps=3`), layout keys aside:
    labels leave them out, the summary states them once.

    >>> common_settings(["determinism=on,steps=3", "determinism=off,steps=3"])
    {'steps': '3'}
    """
    parsed = [parse_cell(c) for c in cells]
    if not parsed:
        return {}
    shared = set(parsed[0].items()).intersection(*(p.items() for p in parsed[1:]))
    return {k: v for k, v in sorted(shared) if k not in LAYOUT_KEYS}


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _sentence(parts: list[str]) -> str:
    s = "; ".join(p for p in parts if p)
    return s[:1].upper() + s[1:] + "." if s else ""


def facts(sweep: Sweep) -> dict:
    """Per-sweep numbers: verdict counts per determinism setting, divergence steps and stages, parameter
    distance at the last step, reward gap and spread at the end, step-time ratio on/off, mismatch."""
    v = verdicts(sweep)
    f: dict = {"cells": len(v)}
    f["incomplete_cells"] = int((v.repeats < 2).sum())
    for mode in ("on", "off"):
        vm = v[(v.determinism == mode) & (v.repeats >= 2)]  # cells with two complete repeats to compare
        div = vm[vm.first_divergence_step.notna()]
        f[mode] = {
            "cells": len(vm),
            "identical": int((vm.verdict == "bitwise identical").sum()),
            "diverging": len(div),
            "first_steps": sorted({int(s) for s in div.first_divergence_step}),
            "stages": Counter(div.first_divergence_stage),
            "mismatch_max": float(vm.mismatch_max.max())
            if len(vm) and vm.mismatch_max.notna().any()
            else None,
        }
    f["hosts"], f["mixed_host_cells"] = hosts(sweep.runs)
    dist = distances(sweep, "param")
    if len(dist):
        last = dist.loc[dist.groupby("cell").step.idxmax()].set_index("cell")
        det = v.set_index("cell").determinism
        for mode in ("on", "off"):
            d = last[last.index.map(det) == mode]
            f[mode]["distance_last"] = (
                (float(d["median"].median()), float(d["min"].min()), float(d["max"].max()))
                if len(d)
                else None
            )
            f[mode]["distance_all_zero"] = bool(len(d)) and bool(
                (dist[dist.cell.map(det) == mode]["max"] == 0).all()
            )
        f["distance_step"] = int(dist.step.max())
        m = sweep.metrics
        if len(m) and "drift/param_norm" in m:
            f["param_norm"] = float(m[m.step == f["distance_step"]]["drift/param_norm"].median())
    # reward at the end: mean of each run's last REWARD_WINDOW steps; per cell the mean over repeats and their
    # spread (max - min); on vs off of each setting
    complete = v.set_index("cell")
    m = sweep.metrics
    if len(m) and "critic/score/mean" in m:
        runs = sweep.runs[sweep.runs.status == "complete"]
        m = m[m.run.isin(runs.run)].sort_values("step")
        tail = m.groupby("run").tail(REWARD_WINDOW).groupby(["cell", "run"])["critic/score/mean"].mean()
        per_cell = tail.groupby(level="cell").agg(["mean", "min", "max"])
        det = complete.determinism
        gaps = []
        for _, g in per_cell.groupby(lambda c: without(c, "determinism")):
            modes = {det[c]: g.loc[c, "mean"] for c in g.index}
            if {"on", "off"} <= set(modes):
                gaps.append(abs(modes["on"] - modes["off"]))
        if len(per_cell):
            last = int(m.step.max())
            f["reward_gap_max"] = max(gaps) if gaps else None
            f["reward_spread_max"] = float((per_cell["max"] - per_cell["min"]).max())
            f["reward_steps"] = (max(1, last - REWARD_WINDOW + 1), last)
    # step time: on / off for each setting
    t = v.set_index("cell")
    ratios = []
    for _, g in t.groupby(lambda c: without(c, "determinism")):
        modes = dict(zip(g.determinism, g.step_time_s))
        if {"on", "off"} <= set(modes) and modes["off"]:
            ratios.append(modes["on"] / modes["off"])
    f["time_ratio"] = (float(np.median(ratios)), min(ratios), max(ratios)) if ratios else None
    # how much runs of one cell (same work) differ in median step time: the noise floor of those ratios
    m = sweep.metrics
    if len(m) and "timing_s/step" in m:
        per_run = (
            m[m.run.isin(sweep.runs[sweep.runs.status == "complete"].run)]
            .groupby(["cell", "run"])["timing_s/step"]
            .median()
        )
        noise = per_run.groupby(level="cell").agg(lambda x: x.max() / x.min() if x.min() > 0 else np.nan)
        f["time_noise"] = float(noise.max()) if noise.notna().any() else None
    return f


def hosts(runs) -> tuple[list[str], int]:
    """The machines the runs name in their numerics contracts, and how many cells have repeats on more than one
    (their repeats differ by the machines' kernels too, not by the sweep's sources alone)."""
    if "host" not in runs or runs.host.isna().all():
        return [], 0
    known = runs[runs.host.notna()]
    return sorted(known.host.unique()), int((known.groupby("cell").host.nunique() > 1).sum())


def host_clause(f: dict) -> str:
    """ "" for one machine; else which ones, and the cells whose repeats they split."""
    hosts = f.get("hosts") or []
    if len(hosts) < 2:
        return ""
    out = f"the runs come from {len(hosts)} machines ({' / '.join(hosts)})"
    n = f["mixed_host_cells"]
    if n:
        out += (
            f", and {_plural(n, 'cell')} {'has' if n == 1 else 'have'} repeats on more than one: their "
            "differences include the machines' kernels, not the sweep's sources alone"
        )
    return out


def _on_clause(on: dict) -> str:
    n, k = on["cells"], on["identical"]
    if n == 1:
        return f"the determinism=on cell is {'' if k else 'not '}bitwise identical across its repeats"
    return f"{k} of the {n} determinism=on cells are bitwise identical across repeats"


def divergence_sentence(f: dict) -> str:
    on, off = f["on"], f["off"]
    parts = [_on_clause(on)] if on["cells"] else []
    if off["cells"] and off["diverging"]:
        stages = ", ".join(f"{s} in {n} of them" for s, n in off["stages"].most_common())
        steps = " or ".join(str(s) for s in off["first_steps"])
        which = (
            "the determinism=off cell diverges"
            if off["cells"] == 1
            else f"{off['diverging']} of the {off['cells']} determinism=off cells diverge"
        )
        stages = stages.replace(" in 1 of them", "") if off["diverging"] == 1 else stages
        parts.append(
            f"{which}, at step {steps}; the first stage to differ (order -> tokens -> logprobs -> params) is "
            f"{stages}"
        )
    elif off["cells"]:
        parts.append(
            "the determinism=off cell does not diverge"
            if off["cells"] == 1
            else f"none of the {off['cells']} determinism=off cells diverge"
        )
    parts.append(host_clause(f))  # "" (dropped) for one machine
    if f["incomplete_cells"]:
        n = f["incomplete_cells"]
        parts.append(f"{_plural(n, 'cell')} {'has' if n == 1 else 'have'} fewer than 2 complete repeats")
    return _sentence(parts) or "No cells."


def distance_sentence(f: dict) -> str:
    if "distance_step" not in f:
        if f["on"]["cells"] + f["off"]["cells"] == 0:
            return "No cell has 2 complete repeats, so no distances between repeats."
        return "No drift sketches were logged (runs from before drift.jsonl), so no distances."
    out = []
    off, on = f["off"].get("distance_last"), f["on"].get("distance_last")
    if off:
        rel = f" = {100 * off[0] / f['param_norm']:.2g}% of the parameter norm" if f.get("param_norm") else ""
        out.append(
            f"off repeats end {_fmt(off[0])} apart in parameter L2 at step {f['distance_step']}{rel}"
            + (
                ""
                if _fmt(off[1]) == _fmt(off[2])
                else f" (median over cells; pairs range {_fmt(off[1])}-{_fmt(off[2])})"
            )
        )
    if on:
        out.append(
            "on repeats stay at exactly 0"
            if f["on"]["distance_all_zero"]
            else f"on repeats reach {_fmt(on[2])}"
        )
    return _sentence(out)


def time_sentence(f: dict) -> str:
    r = f.get("time_ratio")
    if not r:
        return ""
    lo, hi = f"{100 * (r[1] - 1):+.0f}%", f"{100 * (r[2] - 1):+.0f}%"
    notes = [f"{lo} to {hi} across settings"] if lo != hi else []
    if f.get("time_noise"):
        notes.append(f"repeats of one cell differ by up to {f['time_noise']:.2f}x")
    return f"determinism=on changes the median step time by {100 * (r[0] - 1):+.0f}%" + (
        f" ({'; '.join(notes)})" if notes else ""
    )


def reward_sentence(f: dict) -> str:
    out = []
    if f.get("reward_gap_max") is not None:
        lo, hi = f["reward_steps"]
        out.append(
            f"over steps {lo}-{hi} on and off mean rewards differ by at most {f['reward_gap_max']:.3f}, "
            f"while repeats of one cell spread by up to {f['reward_spread_max']:.3f}"
        )
    return _sentence([*out, time_sentence(f)])


def findings(sweep: Sweep) -> list[str]:
    """Three sentences: whether runs differ and where they part; how far they drift; what on costs and changes."""
    f = facts(sweep)
    return [s for s in (divergence_sentence(f), distance_sentence(f), reward_sentence(f)) if s]
