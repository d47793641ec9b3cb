"""The killed-and-resumed runs of test_resume and test_reliable_signals: the command, its environment, and the
uninterrupted run's fingerprints, computed once per test session for every pytest-xdist worker."""

from __future__ import annotations

import fcntl
import json
import os
import sys

from detrl.analysis import FP_ORDER, load_metrics
from tests.conftest import TINY, make_cfg

STEPS = 6


def cmd(run_dir, *extra):
    tiny = [o for o in TINY if not o.startswith(("steps=", "train_batch_size="))]
    # a larger batch than TINY's: steps long enough to be killed in the middle of one
    return [
        sys.executable,
        "train.py",
        *tiny,
        f"steps={STEPS}",
        "train_batch_size=16",
        "checkpoint.every=2",
        f"run_dir={run_dir}",
        *extra,
    ]


# each run gets its own W&B service, as separate `python train.py` invocations do: an earlier in-process
# test's service (WANDB_SERVICE in os.environ) would keep the killed run's id "in use"
ENV = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}


def straight_fps(tmp_path_factory, *extra: str) -> list[list]:
    """The uninterrupted run's fingerprints at every step, run in-process once per config and session (the
    logger changes no fingerprint, so it is left out of the key): under xdist the workers share the session's
    base directory, and a lock per config makes the first worker run it and the others read its file."""
    from detrl.trainer import train

    key = tuple(o for o in extra if not o.startswith("logger="))
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = "straight-" + "-".join(o.replace("/", "_") for o in key)
    done = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            run_dir = tmp_path_factory.mktemp("straight")
            args = [o for o in cmd(run_dir, *key)[2:] if not o.startswith("run_dir=")]
            train(make_cfg(*args, "logger=none"), run_dir)
            fps = [[r[k] for k in FP_ORDER] for r in load_metrics(run_dir)]
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(fps))
            tmp.rename(done)
    return json.loads(done.read_text())
