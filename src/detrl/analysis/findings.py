"""The numbers a report's titles and opening sentences state, computed from a sweep (nothing hand-written)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from detrl.analysis.drift import distances
from detrl.analysis.load import Sweep
from detrl.analysis.verdicts import spread, verdicts


def parse_cell(cell: str) -> dict[str, str]:
    """"algo=dapo,determinism=off" -> {"algo": "dapo", "determinism": "off"} ("default" -> {})."""
    return dict(p.split("=", 1) for p in cell.split(",") if "=" in p)


def without(cell: str, *keys: str) -> str:
    """The cell's settings minus `keys`, as a label ("all" when nothing is left)."""
    return ",".join(f"{k}={v}" for k, v in sorted(parse_cell(cell).items()) if k not in keys) or "all"


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
    for mode in ("on", "off"):
        vm = v[v.determinism == mode]
        div = vm[vm.first_divergence_step.notna()]
        f[mode] = {
            "cells": len(vm), "identical": int((vm.verdict == "bitwise identical").sum()),
            "diverging": len(div),
            "first_steps": sorted({int(s) for s in div.first_divergence_step}),
            "stages": Counter(div.first_divergence_stage),
            "mismatch_max": float(vm.mismatch_max.max()) if len(vm) and vm.mismatch_max.notna().any() else None,
        }
    dist = distances(sweep, "param")
    if len(dist):
        last = dist.loc[dist.groupby("cell").step.idxmax()].set_index("cell")
        det = v.set_index("cell").determinism
        for mode in ("on", "off"):
            d = last[last.index.map(det) == mode]
            f[mode]["distance_last"] = (float(d["median"].median()), float(d["min"].min()), float(d["max"].max())) \
                if len(d) else None
            f[mode]["distance_all_zero"] = bool(len(d)) and bool((dist[dist.cell.map(det) == mode]["max"] == 0).all())
        f["distance_step"] = int(dist.step.max())
    # reward at the end: on vs off per setting (mean of repeats), and the spread across repeats
    s = spread(sweep, "critic/score/mean")
    if len(s):
        end = s.loc[s.groupby("cell").step.idxmax()].set_index("cell")
        det = v.set_index("cell").determinism
        gaps = []
        for _, g in end.groupby(lambda c: without(c, "determinism")):
            modes = {det[c]: g.loc[c, "mean"] for c in g.index}
            if {"on", "off"} <= set(modes):
                gaps.append(abs(modes["on"] - modes["off"]))
        f["reward_gap_max"] = max(gaps) if gaps else None
        f["reward_spread_max"] = float((end["max"] - end["min"]).max())
        f["reward_step"] = int(end.step.max())
    # step time: on / off for each setting
    t = v.set_index("cell")
    ratios = []
    for _, g in t.groupby(lambda c: without(c, "determinism")):
        modes = dict(zip(g.determinism, g.step_time_s))
        if {"on", "off"} <= set(modes) and modes["off"]:
            ratios.append(modes["on"] / modes["off"])
    f["time_ratio"] = (float(np.median(ratios)), min(ratios), max(ratios)) if ratios else None
    return f


def divergence_sentence(f: dict) -> str:
    on, off = f["on"], f["off"]
    parts = []
    if on["cells"]:
        parts.append(f"{on['identical']} of {on['cells']} determinism=on cells are bitwise identical across repeats")
    if off["cells"]:
        stages = ", ".join(f"{s} in {n} of them" for s, n in off["stages"].most_common())
        steps = " or ".join(str(s) for s in off["first_steps"]) or "-"
        parts.append(f"{off['diverging']} of {off['cells']} determinism=off cells diverge, at step {steps}"
                     + (f"; the first stage to differ (order -> tokens -> logprobs -> params) is {stages}"
                        if stages else ""))
    return _sentence(parts) or "No cells."


def distance_sentence(f: dict) -> str:
    if "distance_step" not in f:
        return "No drift sketches were logged (runs from before drift.jsonl), so no distances."
    out = []
    off, on = f["off"].get("distance_last"), f["on"].get("distance_last")
    if off:
        out.append(f"off repeats end {_fmt(off[0])} apart in parameter L2 at step {f['distance_step']} "
                   f"(median over cells, pairs range {_fmt(off[1])}-{_fmt(off[2])})")
    if on:
        out.append("on repeats stay at exactly 0" if f["on"]["distance_all_zero"]
                   else f"on repeats reach {_fmt(on[2])}")
    return _sentence(out)


def time_sentence(f: dict) -> str:
    r = f.get("time_ratio")
    if not r:
        return ""
    return (f"determinism=on changes the median step time by {100 * (r[0] - 1):+.0f}% "
            f"({100 * (r[1] - 1):+.0f}% to {100 * (r[2] - 1):+.0f}% across settings)")


def reward_sentence(f: dict) -> str:
    out = []
    if f.get("reward_gap_max") is not None:
        out.append(f"at step {f['reward_step']} on and off reward means differ by at most {f['reward_gap_max']:.3f}, "
                   f"while repeats of one cell spread by up to {f['reward_spread_max']:.3f}")
    return _sentence([*out, time_sentence(f)])


def findings(sweep: Sweep) -> list[str]:
    """Three sentences: whether runs differ and where they part; how far they drift; what on costs and changes."""
    f = facts(sweep)
    return [s for s in (divergence_sentence(f), distance_sentence(f), reward_sentence(f)) if s]


def cells_frame(sweep: Sweep) -> pd.DataFrame:
    """One row per cell: its parsed settings (for panel layouts)."""
    cells = sorted(sweep.runs.cell.unique())
    return pd.DataFrame([{"cell": c, **parse_cell(c)} for c in cells])
