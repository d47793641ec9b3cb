"""The report on the sweeps a user starts with: one cell, a partial ablation, on/off with a fixed override."""

import shutil
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from detrl.analysis import load_sweep
from detrl.analysis.ablation import ablation_table, ablation_title
from detrl.analysis.findings import common_settings, distance_sentence, divergence_sentence, time_sentence
from detrl.report import fig_cost, fig_reward, main, render
from tests.conftest import ROOT

SMALL = ["steps=2", "train_batch_size=4", "rollout.n=4", "warmstart.steps=40", "logger=none"]


def sweep(out, *grid):
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", *grid, *SMALL, f"hydra.sweep.dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    return sweep(tmp_path_factory.mktemp("s") / "abl", "ablation=all_on,no_sampling", "repeat=0,1")


@pytest.fixture(scope="module")
def onoff(tmp_path_factory):
    return sweep(tmp_path_factory.mktemp("s") / "onoff", "determinism=on,off", "repeat=0,1")[0]


def test_a_sweep_ends_by_printing_its_report_command(ablation):
    out, stdout = ablation
    assert f"python -m detrl.report {out}" in stdout.splitlines()[-1]


def test_a_single_cell_sweep_reports_only_what_it_ran(ablation, tmp_path, capsys):
    one = tmp_path / "one"
    run = next(p for p in sorted(ablation[0].iterdir()) if "no_sampling" in p.name)
    shutil.copytree(run, one / run.name)
    main([str(one)])  # the command a user runs (raised AttributeError on the ablation title)
    summary = (one / "report" / "summary.md").read_text()
    assert (
        "restore" not in summary and "pinned alone" not in summary and "makes repeats diverge" not in summary
    )
    assert "no_sampling: fewer than 2 complete repeats, no verdict" in summary
    assert "1 run in 1 cell" in summary and "every run: rollout.n=4, steps=2," in summary
    assert "### steps=2" not in summary and "**steps=2**" not in summary  # not a setting of the grid
    assert (one / "report" / "ablation.png").is_file()


def test_a_partial_ablation_states_findings_only_of_the_cells_it_ran(ablation, tmp_path):
    summary = (render(ablation[0], tmp_path / "r") / "summary.md").read_text()
    section = summary.split("## Which source")[1]
    assert (
        "released alone from `on`" in section and "sampling change the bits but stay reproducible" in section
    )
    assert "pinned alone" not in section and "restore" not in section  # no only_* cell ran
    assert "4 runs in 2 cells" in summary and "2 complete repeats per cell" in summary
    title = ablation_title(ablation_table(load_sweep(ablation[0])))
    assert (
        title.startswith("Released alone from on, sampling keeps repeats bitwise identical")
        and "pinned" not in title
    )


def test_an_outputs_runs_date_dir_of_single_runs_renders(tmp_path):
    day = tmp_path / "runs" / "2026-12-02"
    proc = subprocess.run(
        [sys.executable, "train.py", "ablation=no_sampling", *SMALL, f"hydra.run.dir={day}/10-00-00_x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    main([str(day)])
    assert "no verdict" in (day / "report" / "summary.md").read_text()


def test_on_off_sweep_titles_fit_and_panels_omit_the_fixed_overrides(onoff, tmp_path):
    s = load_sweep(onoff)
    assert common_settings(s.runs.cell.unique())["steps"] == "2"
    fig = fig_cost(s)
    fig.canvas.draw()
    ax = fig.axes[0]
    box = ax.title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox)  # not clipped at either side
    assert all("steps=" not in t.get_text() for t in ax.get_xticklabels())
    plt.close(fig)
    fig = fig_reward(s)
    assert [a.get_title() for a in fig.axes if a.get_visible()] == ["all"]  # not "steps=2"
    plt.close(fig)
    summary = (render(onoff, tmp_path / "r") / "summary.md").read_text()
    opening = summary.split("\n\n")[1]
    assert opening.startswith("The determinism=on cell is bitwise identical across its repeats")
    assert "4 runs in 2 cells (1 determinism=on, 1 determinism=off)" in summary


def test_runs_gathered_on_two_machines_are_named_and_their_split_cell_counted(onoff, tmp_path):
    """A run's numerics contract names its machine: one machine is named in the runs line; runs from two (a
    sweep merged from two hosts) are named in the findings with the cells whose repeats they split, from the
    local files and from W&B (the run's uploaded numerics.json) alike."""
    import json

    from tests.test_drift import FakeApi, FakeRun

    s = load_sweep(onoff)
    (host,) = set(s.runs.host)
    assert host.startswith(json.loads((next(onoff.glob("*/numerics.json"))).read_text())["host"]["cpu"])
    summary = (render(onoff, tmp_path / "one") / "summary.md").read_text()
    assert f"; on {host}" in summary and "machines" not in summary
    merged = tmp_path / "merged"
    shutil.copytree(onoff, merged)
    moved = sorted(merged.glob("*determinism=on*repeat=1*/numerics.json"))
    assert len(moved) == 1
    contract = json.loads(moved[0].read_text())
    contract["host"] = {"cpu": "Other CPU", "isa": "AVX512", "blas": "mkl"}
    moved[0].write_text(json.dumps(contract))
    for s in (load_sweep(merged), load_sweep(wandb_path="e/p/g", api=FakeApi(_fake_runs(merged, FakeRun)))):
        assert sorted(s.runs.host) == sorted([host] * 3 + ["Other CPU (AVX512, mkl)"])
    summary = (render(merged, tmp_path / "two") / "summary.md").read_text()
    names = " / ".join(sorted([host, "Other CPU (AVX512, mkl)"]))
    assert f"the runs come from 2 machines ({names}), and 1 cell has repeats on more than one" in summary
    assert "; on " not in summary.split("\n\n")[2]


def _fake_runs(sweep_dir, fake_run):
    return [fake_run(p, i) for i, p in enumerate(sorted(p.parent for p in sweep_dir.glob("*/metrics.jsonl")))]


def _facts(on_cells=1, off_cells=1):
    from collections import Counter

    cell = dict(identical=0, diverging=0, first_steps=[], stages=Counter(), mismatch_max=0.0)
    return {
        "cells": on_cells + off_cells,
        "incomplete_cells": 0,
        "on": {**cell, "cells": on_cells, "identical": on_cells},
        "off": {
            **cell,
            "cells": off_cells,
            "diverging": off_cells,
            "first_steps": [1],
            "stages": Counter(order=off_cells),
        },
    }


def test_sentences_print_a_degenerate_range_as_one_value():
    f = _facts()
    f["off"]["distance_last"] = (1.25, 1.25, 1.25)
    f["on"].update(distance_last=(0.0, 0.0, 0.0), distance_all_zero=True)
    f["distance_step"], f["time_ratio"] = 2, (1.3, 1.3, 1.3)
    assert "1.25-1.25" not in distance_sentence(f) and "1.25 apart" in distance_sentence(f)
    assert time_sentence(f) == "determinism=on changes the median step time by +30%"
    f["time_ratio"] = (1.3, 1.1, 1.5)
    assert "+10% to +50% across settings" in time_sentence(f)
    assert divergence_sentence(f).startswith("The determinism=on cell is bitwise identical")
    assert "the determinism=off cell diverges, at step 1" in divergence_sentence(f)
    assert divergence_sentence(_facts(8, 8)).startswith(
        "8 of the 8 determinism=on cells are bitwise identical"
    )


def test_make_notebooks_runner_executes_the_notebook_on_a_single_cell_sweep(ablation, tmp_path):
    one = tmp_path / "one"
    run = next(p for p in sorted(ablation[0].iterdir()) if "no_sampling" in p.name)
    shutil.copytree(run, one / run.name)
    proc = subprocess.run(
        [sys.executable, "notebooks/run.py", str(one)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import nbformat

    nb = nbformat.read(one / "report" / "nondeterminism_report.ipynb", as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5


def test_the_report_and_compare_commands_do_not_load_the_model_code():
    """`python -m detrl.report` / `detrl.compare` read metrics files: importing them leaves transformers and the
    engine unimported (they were ~6 s of each command's start), while `detrl.rollout.EmbeddedEngine` still
    resolves on first use."""
    code = (
        "import sys, detrl.report, detrl.compare\n"
        "print(any(m.startswith('transformers') for m in sys.modules), 'detrl.rollout.embedded' in sys.modules)\n"
        "from detrl.rollout import EmbeddedEngine\n"
        "print(EmbeddedEngine.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False", "detrl.rollout.embedded"], out.stdout
