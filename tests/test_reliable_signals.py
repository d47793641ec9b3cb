"""SIGINT / SIGTERM: the run stops in one line naming how to resume (no traceback), W&B is finished, a signal
during a step's log / checkpoint checkpoints that step, and the resumed run equals an uninterrupted one bitwise."""

import os
import signal
import struct
import subprocess
import time

import pytest

from detrl import checkpoint, guards
from detrl.analysis import FP_ORDER, load_metrics
from tests.conftest import ROOT, TINY, make_cfg
from tests.resume_helpers import ENV, STEPS, straight_fps
from tests.resume_helpers import cmd as _cmd


def _wandb_records(path):
    """Record types of a W&B transaction log (LevelDB log format: 32 KiB blocks of crc, length, type, data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, kinds = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            kinds.append(record.WhichOneof("record_type"))
            buf = b""
    return kinds


def _signal_during_step(run_dir, step, signum, *extra):
    """Start a run in its own session and send `signum` to its whole process group (as a terminal's Ctrl-C or
    SLURM's scancel do) while step `step` runs."""
    proc = subprocess.Popen(
        _cmd(run_dir, *extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline, metrics = time.time() + 300, run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step - 1:
            os.killpg(proc.pid, signum)
            break
        time.sleep(0.005)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.mark.parametrize(
    "signum, extra",
    [(signal.SIGTERM, ["logger=wandb"]), (signal.SIGINT, ["logger=none", "model=qwen3_moe"])],
    ids=["sigterm-wandb", "sigint-moe"],
)
def test_a_signal_stops_in_one_line_finishes_wandb_and_resumes_bitwise(
    tmp_path, tmp_path_factory, signum, extra
):
    stopped = tmp_path / "stopped"
    code, err = _signal_during_step(stopped, 4, signum, *extra)
    assert code == 128 + signum, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("detrl:")]
    name = signal.Signals(signum).name
    assert (
        len(lines) == 1 and f"stopped by {name}" in lines[0] and f"resume=auto run_dir={stopped}" in lines[0]
    )
    assert not (stopped / "summary.json").exists() and not list(
        checkpoint.checkpoint_root(stopped).glob(".tmp-*")
    )
    if "logger=wandb" in extra:  # the W&B run was finished: its log ends with an exit record
        (log,) = stopped.glob("wandb/offline-run-*/run-*.wandb")
        assert "exit" in _wandb_records(log)
    resumed = subprocess.run(
        _cmd(stopped, "resume=auto", *extra), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    b = load_metrics(stopped)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert straight_fps(tmp_path_factory, *extra) == [[r[k] for k in FP_ORDER] for r in b]


def test_a_signal_during_a_steps_log_checkpoints_that_step(tmp_path, monkeypatch):
    from detrl.tracking import Tracker
    from detrl.trainer import train

    log = Tracker.log

    def log_then_signal(self, step, metrics):
        if step == 2:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # arrives inside the held section: handled after the checkpoint
        log(self, step, metrics)

    monkeypatch.setattr(Tracker, "log", log_then_signal)
    with pytest.raises(guards.Interrupted) as e, guards.stop_on_signals():
        train(make_cfg(*TINY, "steps=4", "checkpoint.every=0"), tmp_path)  # no checkpoint was due at step 2
    assert e.value.name == "SIGTERM" and checkpoint.latest(tmp_path).name == "step-000002"
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the context
