"""Running a Triton script in a subprocess (Triton's interpreter reads TRITON_INTERPRET at import) and reading the
one JSON line it prints after "RESULT"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_script(script: str, *args: str, interpret: bool = True, timeout: int = 600) -> dict:
    pytest.importorskip(
        "triton"
    )  # the test environment installs it (SGLang's pin); a CPU-only install need not
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
