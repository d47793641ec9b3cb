"""The numerics preflight runs before step 0 of every determinism=on run and refuses, in one line, an op set
that is not batch-invariant on this machine; its result is the run's numerics contract."""

import dataclasses
import json

import pytest
import torch.nn.functional as F

from detrl import determinism
from detrl.config import ConfigError
from tests.conftest import TINY, make_cfg, run_tiny


def test_an_on_run_writes_its_numerics_contract(tmp_path):
    run_tiny(tmp_path, "steps=1")
    contract = json.loads((tmp_path / "numerics.json").read_text())
    assert contract["ops"] == "batch_invariant" and contract["preflight"].startswith("passed")
    # the negative control: the default CPU kernels vary with the batch here (gemm kernels by row count)
    assert contract["negative_control"] and "found nothing" not in contract["negative_control"][0]


def test_a_row_variant_op_set_is_refused_before_step_0(tmp_path, monkeypatch):
    from detrl.trainer import train

    broken = dataclasses.replace(
        determinism.BATCH_INVARIANT_OPS,
        name="broken",
        linear=F.linear,
        attention=determinism.DEFAULT_OPS.attention,
    )
    monkeypatch.setattr(determinism, "BATCH_INVARIANT_OPS", broken)
    with pytest.raises(
        ConfigError, match=r"determinism=on refused: batch invariance not proven on cpu .*broken"
    ):
        train(make_cfg(*TINY, "steps=1"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step
