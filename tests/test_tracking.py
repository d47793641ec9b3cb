"""The W&B run against its run dir, read with wandb's own reader of the offline run (`wandb leet inspect`)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from detrl.config import ConfigError, LoggerConfig
from detrl.tracking import Tracker
from tests.conftest import TINY, make_cfg, read_metrics

WANDB = str(Path(sys.executable).with_name("wandb"))


def wandb_records(offline_run: Path) -> list[dict]:
    """Every record of the run's .wandb transaction log, as wandb-core itself decodes it."""
    out = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(offline_run)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return b is None or b == "NaN" or (isinstance(b, float) and math.isnan(b))
    return a == b


def test_a_fresh_offline_run_carries_its_files_and_the_history_of_metrics_jsonl(tmp_path):
    from detrl.trainer import train

    train(make_cfg(*TINY, "logger=wandb"), tmp_path)
    (offline,) = tmp_path.glob("wandb/offline-run-*")
    records = wandb_records(offline)
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"].get("files", [])}
    assert {"drift.jsonl", "metrics.jsonl", "config.yaml", "numerics.json"} <= saved
    for name in ["drift.jsonl", "metrics.jsonl"]:  # what `wandb sync` uploads is the run dir's file, whole
        assert (offline / "files" / name).read_bytes() == (tmp_path / name).read_bytes()
    history = [r["history"] for r in records if r["type"] == "history"]
    rows = read_metrics(tmp_path)
    assert [int(h["step"]["num"]) for h in history] == [r["step"] for r in rows] == [1, 2, 3]
    for h, row in zip(history, rows):
        item = {k: v for k, v in h["item"].items() if not k.startswith("_")}
        assert set(item) == set(row) - {"step"}
        assert all(same(row[k], item[k]) for k in item), [k for k in item if not same(row[k], item[k])]


def test_online_without_credentials_fails_in_one_line_naming_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    with pytest.raises(ConfigError) as e:
        Tracker(tmp_path, LoggerConfig(mode="online"), "r", "g", {})
    msg = str(e.value)
    assert "\n" not in msg and "wandb login" in msg and "WANDB_MODE=offline" in msg, msg
