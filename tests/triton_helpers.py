"""Running a Triton script in a subprocess (Triton's interpreter reads TRITON_INTERPRET at import) and reading the
one JSON line it prints after "RESULT".

Under the interpreter every script first replaces its `tl.dot` (`TILE_DOT`): the interpreter runs it as `np.matmul`,
whose BLAS gives a row other bits by its place in the tile on some CPUs (this project's AMD EPYC CI machine: 15 of
16 row positions of a 16 x 32 x 16 float32 product, under every OpenBLAS core type), where a GPU's MMA gives a
row's bits from that row and column alone, as the kernels' batch invariance assumes. The stand-in sums each
output's K products in order, so the tests check the kernels' own tiling, masks and reduction order on any CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TILE_DOT = """
import numpy as _np
from triton.runtime import interpreter as _interp

_matmul_dot = _interp.InterpreterBuilder.create_dot


def _tile_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 / int8: the interpreter's own
        return _matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    acc = d.data.dtype
    x, y = a.data.astype(acc), b.data.astype(acc)
    out = _np.zeros((*x.shape[:-1], y.shape[-1]), acc)
    for k in range(x.shape[-1]):  # out[m, n]: the products of row m and column n summed in k order
        out += x[..., :, k, None] * y[..., None, k, :]
    return _interp.TensorHandle(out + d.data, d.dtype.scalar)


_interp.InterpreterBuilder.create_dot = _tile_dot
"""


def run_script(script: str, *args: str, interpret: bool = True, timeout: int = 600) -> dict:
    pytest.importorskip(
        "triton"
    )  # the test environment installs it (SGLang's pin); a CPU-only install need not
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", (TILE_DOT if interpret else "") + script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
