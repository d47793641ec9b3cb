"""The smoke study end to end: Hydra multirun -> sweep dir -> analysis, report and notebook."""

import shutil
import subprocess
import sys

import nbformat
import pytest
from hydra import compose, initialize_config_dir
from nbclient import NotebookClient

from detrl.analysis import distances, divergence_matrix, load_sweep, spread, verdicts
from detrl.cli import wandb_group
from detrl.report import FIGURES, render
from tests.conftest import CONF, ROOT


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweeps") / "smoke"
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "experiment=smoke", "logger=none", f"hydra.sweep.dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_smoke_sweep_writes_one_run_per_cell_and_repeat(sweep_dir):
    sweep = load_sweep(sweep_dir)
    assert len(sweep.runs) == 4 and set(sweep.runs.status) == {"complete"}
    assert sorted(sweep.runs.cell.unique()) == ["determinism=off", "determinism=on"]
    assert sorted(sweep.runs.repeat) == [0, 0, 1, 1]
    assert len(sweep.metrics) == 4 * 4


def test_determinism_on_cell_has_exactly_one_trajectory(sweep_dir):
    v = verdicts(load_sweep(sweep_dir)).set_index("cell")
    assert v.loc["determinism=on", "distinct_trajectories"] == 1
    assert v.loc["determinism=on", "verdict"] == "bitwise identical"
    assert v.loc["determinism=on", "mismatch_max"] == 0.0
    mat = divergence_matrix(load_sweep(sweep_dir))
    assert (mat.loc["determinism=on"] == 1).all()
    assert set(spread(load_sweep(sweep_dir), "critic/score/mean").columns) >= {
        "cell",
        "step",
        "mean",
        "min",
        "max",
    }


def test_report_renders_figures_and_summary(sweep_dir, tmp_path):
    out = render(sweep_dir, tmp_path / "report")
    assert list(FIGURES) == ["distance", "reward", "verdicts", "mismatch", "cost"]
    for name in FIGURES:
        assert (out / f"{name}.png").stat().st_size > 1000
    summary = (out / "summary.md").read_text()
    opening = summary.split("\n\n")[1]  # the findings, computed from the data, before the table
    assert (
        opening.startswith("The determinism=on cell is bitwise identical across its repeats")
        and opening.count(". ") >= 2
    )
    assert "on repeats stay at exactly 0" in opening and "bitwise identical" in summary


def test_every_run_logs_drift_sketches_and_on_repeats_are_exactly_0_apart(sweep_dir):
    sweep = load_sweep(sweep_dir)
    assert all(sorted(d) == [1, 2, 3, 4] for d in sweep.drift.values())
    dist = distances(sweep).set_index("cell")
    assert (dist.loc["determinism=on", "max"] == 0).all()
    assert "drift/param_norm" in sweep.metrics and (sweep.metrics["drift/param_norm"] > 0).all()


def test_notebook_runs_headless_against_the_sweep(sweep_dir):
    nb = nbformat.read(ROOT / "notebooks" / "nondeterminism_report.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    params[0].source = f"sweep_dir = {str(sweep_dir)!r}\nwandb_path = None"
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) == len(FIGURES)
    verdict_html = next(
        o["data"]["text/html"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "text/html" in o.get("data", {})
    )
    assert "bitwise identical" in verdict_html


def test_killed_and_half_written_runs_load_as_incomplete(sweep_dir, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy)
    victim = sorted(p for p in copy.iterdir() if p.is_dir())[0]
    (victim / "summary.json").unlink()
    text = (victim / "metrics.jsonl").read_text()
    (victim / "metrics.jsonl").write_text(text[: len(text) - 40])  # cut mid-line, as a kill mid-write would
    never_started = copy / "9_determinism=on,repeat=7"
    shutil.copytree(victim / ".hydra", never_started / ".hydra")
    sweep = load_sweep(copy)
    status = sweep.runs.set_index("run").status
    assert status[victim.name] == "incomplete" and status[never_started.name] == "incomplete"
    assert sweep.runs.set_index("run").steps_logged[victim.name] == 3
    v = verdicts(sweep).set_index("cell")
    assert v.loc["determinism=on", "incomplete"] >= 1
    render(copy, tmp_path / "report")  # still renders


def test_launchers_compose_for_parallel_and_slurm_sweeps():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        joblib = compose(
            "train", overrides=["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], return_hydra_config=True
        )
        slurm = compose(
            "train",
            overrides=["hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=30"],
            return_hydra_config=True,
        )
    assert "joblib" in joblib.hydra.launcher._target_ and joblib.hydra.launcher.n_jobs == 2
    assert "submitit" in slurm.hydra.launcher._target_ and slurm.hydra.launcher.timeout_min == 30


def test_every_experiment_preset_composes():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for name in ("smoke", "determinism_matrix"):
            cfg = compose("train", overrides=[f"experiment={name}"], return_hydra_config=True)
            assert cfg.experiment == name and cfg.hydra.sweeper.params


def test_wandb_group_is_the_sweep_name():
    assert wandb_group(True, "/x/outputs/sweeps/smoke_2026", "smoke") == "smoke_2026"
    assert wandb_group(False, "/x/sweeps/y", "smoke") == "smoke"
    assert wandb_group(False, "/x/sweeps/y", None) == "single"


def test_source_ablation_preset_renders_its_section(tmp_path):
    """A small grid of the ablation preset end to end: cells by `ablation=`, the table's reading of each
    (bitwise repeats or not, where a leave-one-out cell leaves all-on's bits), the section and its figure."""
    from detrl.analysis.ablation import ablation_table

    out = tmp_path / "ablation"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "experiment=source_ablation",
            "model=qwen3",
            "steps=2",
            "train_batch_size=4",
            "rollout.n=4",
            "warmstart.steps=40",
            "ablation=all_on,no_sampling,no_routing",
            "repeat=0,1",
            f"hydra.sweep.dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweep = load_sweep(out)
    t = ablation_table(sweep).set_index("ablation")
    assert sorted(t.index) == ["all_on", "no_routing", "no_sampling"] and (t.repeats == 2).all()
    assert t.loc["all_on", "reproducible"] and t.loc["all_on", "reward_spread"] == 0
    assert t.loc["no_sampling", "differs_from_all_on"] == "step 1, tokens"
    assert t.loc["no_routing", "differs_from_all_on"] == "no: bitwise equal"
    assert t.loc["no_sampling", "kind"] == "leave-one-out" and t.loc["all_on", "kind"] == "reference"
    report = render(out, tmp_path / "report")
    summary = (report / "summary.md").read_text()
    assert "## Which source causes divergence" in summary and (report / "ablation.png").is_file()
    assert "sampling change the bits but stay reproducible" in summary
