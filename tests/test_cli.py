"""What a user reads from `python train.py`: a line before the build, the last line, no empty train.log."""

import subprocess
import sys

from detrl.cli import reward_line
from tests.conftest import ROOT, TINY


def test_the_reward_line_never_compares_overlapping_windows():
    rows = [{"step": s, "critic/score/mean": s / 10} for s in range(1, 5)]
    assert reward_line(rows, "d").startswith(
        "reward: first 0.150 -> last 0.350 over 4 steps (1-4; means of 2"
    )
    assert reward_line(rows[:1], "d") == "reward: 0.100 over 1 step (1); run dir d"
    many = [{"step": s, "critic/score/mean": s / 100} for s in range(1, 61)]
    assert reward_line(many, "d").startswith(
        "reward: first 0.030 -> last 0.580 over 60 steps (1-60; means of 5"
    )


def train(*args):
    proc = subprocess.run(
        [sys.executable, "train.py", *TINY, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_a_run_says_what_it_builds_first_and_a_resumed_run_counts_the_steps_its_dir_holds(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    out = train("steps=2", f"run_dir={a}", f"hydra.run.dir={a}")
    assert out[0].startswith("detrl: building qwen3 from the warm start") and f"run dir {a}" in out[0]
    assert out[-1].startswith("reward: first ") and "over 2 steps (1-2; means of 1 step)" in out[-1]
    assert not (a / "train.log").exists()  # nothing logs through logging: no empty file
    # resumed into another dir from a's step-2 checkpoint: b holds step 3 only
    out = train("steps=3", f"resume={a}/checkpoints/step-000002", f"run_dir={b}")
    assert out[-1] == f"reward: {float(_last_reward(b)):.3f} over 1 step (3); run dir {b}", out[-1]


def _last_reward(run_dir):
    import json

    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["critic/score/mean"]


def test_neither_entrypoint_configures_a_log_file():
    """Nothing logs through `logging` but to the console: Hydra's default file handler wrote empty
    train.log / probe.log files."""
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for name in ("train", "probe"):
            handlers = compose(name, return_hydra_config=True).hydra.job_logging.handlers
            assert "file" not in handlers and "console" in handlers, name
