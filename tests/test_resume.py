"""Exact resume: a run killed with SIGKILL mid-step and resumed equals an uninterrupted run, bitwise."""

import os
import signal
import subprocess
import time

import pytest
import torch

from detrl import checkpoint
from detrl.analysis import FP_ORDER, load_metrics
from detrl.config import ConfigError
from tests.conftest import ROOT, TINY, make_cfg, run_tiny
from tests.resume_helpers import ENV, STEPS, straight_fps
from tests.resume_helpers import cmd as _cmd


def _kill_during_step(run_dir, step, *extra):
    """Start a run and SIGKILL it while step `step` runs (as soon as step - 1 is logged)."""
    proc = subprocess.Popen(
        _cmd(run_dir, *extra), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
    )
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step - 1:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


@pytest.mark.parametrize(
    "extra",
    [
        ["logger=wandb"],
        [
            "model=qwen3_moe",
            "algo=dapo",
            "logger=none",
            "algo.ppo_mini_batch_size=4",
            "optim.lr_scheduler_type=cosine",
            "optim.lr_warmup_steps=2",
            "optim.min_lr_ratio=0.1",
        ],
        ["rollout.partial.enabled=true", "model=qwen3_moe", "logger=none"],
    ],
    ids=["dense-grpo-wandb", "moe-dapo", "moe-partial"],
)
def test_sigkill_mid_step_then_resume_equals_an_uninterrupted_run(tmp_path, tmp_path_factory, extra):
    killed = tmp_path / "killed"
    _kill_during_step(killed, 4, *extra)
    assert len(load_metrics(killed)) >= 3 and not (killed / "summary.json").exists()
    assert checkpoint.latest(killed).name in ("step-000002", "step-000004")
    resumed = subprocess.run(
        _cmd(killed, "resume=auto", *extra), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    b = load_metrics(killed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))  # no step logged twice
    assert straight_fps(tmp_path_factory, *extra) == [[r[k] for k in FP_ORDER] for r in b]
    if "rollout.partial.enabled=true" in extra:  # the buffer was carried through the checkpoint
        assert max(r["partial/carried"] for r in b) > 0
    if "logger=wandb" in extra:  # the resumed process continued the same W&B run
        # (both processes' offline dirs share the id; started within one second they share the dir too)
        ids = {p.name.rsplit("-", 1)[-1] for p in (killed / "wandb").glob("offline-run-*")}
        assert len(ids) == 1


def test_a_half_written_checkpoint_leaves_the_previous_one_usable(tmp_path):
    run_tiny(tmp_path, "checkpoint.every=1")
    root = checkpoint.checkpoint_root(tmp_path)
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-000002", "step-000003"]  # keep_last=2
    torch_tmp = root / ".tmp-killed"
    torch_tmp.mkdir()
    (torch_tmp / "state.pt").write_bytes(b"\x80\x02 half a pickle")
    assert checkpoint.latest(tmp_path).name == "step-000003"
    rows = run_tiny(tmp_path, "resume=auto", "steps=4", "checkpoint.every=1")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_resume_with_a_changed_config_is_refused_and_loses_nothing(tmp_path):
    from detrl.trainer import train

    run_tiny(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"seed=1 differs .* checkpoint.allow_config_change=true"):
        train(make_cfg(*TINY, "seed=1", "resume=auto", "steps=4"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert checkpoint.latest(tmp_path).name == "step-000003"
    train(
        make_cfg(*TINY, "seed=1", "resume=auto", "steps=4", "checkpoint.allow_config_change=true"), tmp_path
    )
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]


def test_resume_from_a_path_without_checkpoints_names_it(tmp_path):
    with pytest.raises(ConfigError, match="resume="):
        checkpoint.resolve(str(tmp_path), tmp_path)
    assert checkpoint.resolve("auto", tmp_path) is None  # auto on a fresh dir: start fresh
    assert checkpoint.resolve(None, tmp_path) is None


def test_checkpoint_holds_every_rng_and_the_optimizer(tmp_path):
    run_tiny(tmp_path)
    payload = torch.load(checkpoint.latest(tmp_path) / "state.pt", weights_only=True)
    assert set(payload["rng"]) == {"python", "numpy", "torch", "engine"}
    assert payload["optimizer"]["state"] and payload["run"]["step"] == 3 and payload["run"]["data_pos"] > 0
    assert payload["run"]["wandb_id"]


def test_a_fresh_run_in_a_used_run_dir_is_refused_and_loses_nothing(tmp_path):
    from detrl.trainer import train

    run_tiny(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"run_dir=.* already holds a run .* resume=auto"):
        train(make_cfg(*TINY), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert checkpoint.latest(tmp_path).name == "step-000003"


def test_resume_auto_without_a_checkpoint_starts_clean(tmp_path):
    # a run killed before its first checkpoint left rows behind: resume=auto starts over, without them
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "fp/params": "stale"}\n{"step": 2, "fp/params": "stale"}\n'
    )
    rows = run_tiny(tmp_path, "resume=auto")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["fp/params"] != "stale" for r in rows)
