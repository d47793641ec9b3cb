"""detrl.compare and the report's Variance section on tiny real sweeps (seeds x repeats, a few steps)."""

import subprocess
import sys

import numpy as np
import pytest

from detrl.analysis import load_sweep
from detrl.analysis.variance import run_values
from detrl.compare import compare, main
from detrl.report import render
from tests.conftest import ROOT
from tests.test_drift import FakeApi, FakeRun

TINY = [
    "steps=6",
    "train_batch_size=8",
    "rollout.n=4",
    "algo.ppo_mini_batch_size=4",  # 2 optimizer steps a batch: the second mini-batch sees the first step's move
    "warmstart.steps=40",
    "logger=none",
    "checkpoint.save_final=false",
    "eval.every=3",
    "data.eval_fraction=0.2",
    "seed=0,1,2,3",
    "repeat=0,1",
]
LR_B = "lr=1e-5"  # sweep B differs from A (lr=1e-3) only in this (lr must be > 0)


def sweep(out, *overrides):
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", *TINY, *overrides, f"hydra.sweep.dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    return {
        "a": sweep(root / "a", "determinism=on,off"),  # 16 runs: 4 seeds x 2 repeats x on/off
        "a2": sweep(root / "a2", "determinism=off"),  # the same config as A's off half, run again
        "b": sweep(root / "b", "determinism=off", LR_B),  # A's off half with another lr
    }


def test_two_sweeps_differing_in_lr_show_a_difference_with_an_interval(sweeps, capsys):
    """On `actor/ppo_kl`: how far the first optimizer step of a batch moved the policy (the second mini-batch's
    current against its old logprobs), which the lr sets. (The reward barely moves in 6 tiny steps: lr 1e-3 vs
    1e-2 gave A - B = 0.026 [-0.003, 0.05] in one try; lr 2e-2 made the entropy of repeats spread by sd 1.0.)"""
    argv = [str(sweeps["a"]), str(sweeps["b"]), "--where", "determinism=off"]
    c = main([*argv, "--metric", "actor/ppo_kl", "--window", "5"])
    line = capsys.readouterr().out.strip()
    assert c.differs and (c.hi < 0 or c.lo > 0) and c.lo <= c.diff <= c.hi
    assert line.startswith("different: A - B = ") and "95% interval" in line and "\n" not in line
    assert c.seeds == (4, 4) and c.runs == (8, 8)
    assert c.repeat_sd[0] > 0  # determinism=off: the repeats of a seed differ, and that is the noise


def test_two_sweeps_of_one_config_show_no_difference_beyond_the_noise(sweeps, capsys):
    c = main([str(sweeps["a"]), str(sweeps["a2"]), "--where", "determinism=off"])
    line = capsys.readouterr().out.strip()
    assert not c.differs and line.startswith("no difference beyond the noise")
    assert c.lo <= 0 <= c.hi and c.noise > 0


def test_determinism_on_repeats_have_no_noise_and_one_sweep_against_itself_is_exactly_zero(sweeps):
    a = load_sweep(sweeps["a"])
    c = compare(a, a, where=["determinism=on"])
    assert c.diff == 0.0 and c.noise == 0.0 and c.repeat_sd[0] == 0.0
    on = run_values(a, "critic/score/mean", 5)
    on = on[on.config == "determinism=on"]
    assert (on.groupby("seed").value.nunique() == 1).all()  # on: a seed's repeats give the same number


def test_a_wandb_group_reads_as_the_local_sweep(sweeps):
    runs = [FakeRun(p, i) for i, p in enumerate(sorted(sweeps["a2"].glob("*seed=*")))]
    for r in runs:
        r.group = "g"
    remote = main(["wandb:me/detrl/g", str(sweeps["a2"])], api=FakeApi(runs))
    assert remote.diff == 0.0 and remote.seeds == (4, 4)


def test_bad_input_fails_in_one_line(sweeps, capsys):
    for argv, says in [
        ([str(sweeps["a"]), str(sweeps["b"])], "holds 2 configs"),
        ([str(sweeps["a2"]), str(sweeps["b"]), "--metric", "critic/nope"], "critic/nope"),
        ([str(sweeps["a2"]), str(sweeps["b"] / "missing")], "is not a sweep dir"),
        ([str(sweeps["a2"]), str(sweeps["b"]), "--window", "0"], "window=0"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and says in err and "\n" not in err, (argv, err)


def test_report_has_a_variance_section_and_figure(sweeps, tmp_path):
    out = render(sweeps["a"], tmp_path / "report")
    text = (out / "summary.md").read_text()
    assert (out / "variance.png").stat().st_size > 10_000
    section = text[text.index("## Variance") :]
    assert "an off repeat adds" in section and "seeds a config under on" in section
    rows = [r for r in section.splitlines() if r.startswith("| final reward | ") and "determinism=" in r]
    assert len(rows) == 2
    on = next(r for r in rows if "determinism=on" in r).split(" | ")
    assert on[6] == "0 [0, 0]"  # within-seed variance under on: exactly 0, interval too
    off = next(r for r in rows if "determinism=off" in r).split(" | ")
    assert float(off[6].split(" ")[0]) > 0
    assert np.isfinite(float(on[4]))
