"""The numerics preflight runs before step 0 of every determinism=on run and refuses, in one line, an op set
that is not batch-invariant on this machine; its result is the run's numerics contract."""

import dataclasses
import json

import pytest
import torch.nn.functional as F

from detrl.config import ConfigError
from detrl.models import ops as ops_mod
from tests.conftest import TINY, make_cfg, run_tiny


def test_an_on_run_writes_its_numerics_contract(tmp_path):
    run_tiny(tmp_path, "steps=1")
    contract = json.loads((tmp_path / "numerics.json").read_text())
    assert contract["ops"] == "batch_invariant" and contract["preflight"].startswith("passed")
    # the negative control: the default CPU kernels vary with the batch here (gemm kernels by row count)
    assert contract["negative_control"] and "found nothing" not in contract["negative_control"][0]
    # the machine the bits came from, and the gemm kernel family the invariant linear measured per model shape
    import torch

    host = contract["host"]
    assert host["isa"] == torch.backends.cpu.get_cpu_capability() and host["cpu"] and host["blas"]
    cfg = make_cfg(*TINY).model
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {f"{cfg.hidden_size} x {qkv} float32", f"{cfg.intermediate_size} x {cfg.hidden_size} float32"}
    assert shapes <= set(contract["gemm_modes"]), contract["gemm_modes"]
    assert set(contract["gemm_modes"].values()) <= {"fast", "serial", "tiled"}


def test_a_row_variant_op_set_is_refused_before_step_0(tmp_path, monkeypatch):
    from detrl.trainer import train

    broken = dataclasses.replace(
        ops_mod.BATCH_INVARIANT_OPS,
        name="broken",
        linear=F.linear,
        attention=ops_mod.DEFAULT_OPS.attention,
    )
    monkeypatch.setitem(ops_mod.OP_SETS, ("cpu", True), broken)
    with pytest.raises(
        ConfigError, match=r"determinism=on refused: batch invariance not proven on cpu .*broken"
    ):
        train(make_cfg(*TINY, "steps=1"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


def test_the_preflight_never_holds_a_passs_full_logits(monkeypatch):
    """The trainer's rows are scored as the trainer scores them (the lm_head over row chunks): no call of the
    preflight asks for logits over more than the prompt (DAPO's [8, 22,528, V] would be 102 GiB), and it still
    passes and still finds the default ops' differences."""
    import torch

    from detrl.models import preflight
    from detrl.models.build import build_model
    from detrl.models.forward import fuse, rope_tables

    cfg = make_cfg(*TINY, "model.init=random")
    weights = fuse(build_model(cfg.model, seed=0), None)
    ctx_len, prompt_len = 40, 3
    rope = rope_tables(weights.config, ctx_len, torch.device("cpu"), torch.float32)
    widest = []
    real = preflight.forward

    def spy(w, ids, *a, head=True, **kw):
        if head:
            widest.append(ids.shape[1])
        return real(w, ids, *a, head=head, **kw)

    monkeypatch.setattr(preflight, "forward", spy)
    assert preflight.check(weights, ops_mod.BATCH_INVARIANT_OPS, ctx_len, rope, prompt_len=prompt_len) == []
    assert widest and max(widest) <= prompt_len
    assert preflight.check(weights, ops_mod.DEFAULT_OPS, ctx_len, rope, prompt_len=prompt_len)
