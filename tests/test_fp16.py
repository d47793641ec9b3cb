"""model.dtype=float16: dynamic loss scaling on float32 masters, CPU training, and its one-line refusals."""

import json

import pytest
import torch

from detrl.config import ConfigError
from detrl.device import check_compute_dtype, resolve_dtype
from detrl.loss_scale import LossScaler
from detrl.trainer import train
from tests.conftest import TINY, make_cfg


def master_and_copy(value: float = 1.0):
    w = torch.nn.Parameter(torch.full((4,), value))  # float32 master
    return w, torch.optim.SGD([w], lr=1.0)


def test_loss_scaling_recovers_a_gradient_that_float16_flushes_to_zero():
    x = torch.full((4,), 1e-4, dtype=torch.float16)
    grads = {}
    for enabled in (False, True):
        w, opt = master_and_copy()
        scaler = LossScaler(torch.float16 if enabled else torch.float32, torch.device("cpu"))
        loss = (
            w.to(torch.float16) * x
        ).sum() * 1e-4  # d loss / d w = 1e-8: below float16's smallest subnormal
        scaler.scale(loss).backward()
        scaler.unscale(opt)
        grads[enabled] = w.grad.clone()
    assert torch.equal(grads[False], torch.zeros(4))  # unscaled: lost in the half-precision backward
    assert torch.allclose(grads[True], torch.full((4,), 1e-8), rtol=1e-2)  # scaled, then unscaled in float32


def test_an_overflowing_step_is_skipped_and_halves_the_scale():
    w, opt = master_and_copy()
    scaler = LossScaler(torch.float16, torch.device("cpu"), init_scale=2.0**12)
    scaler.scale((w.to(torch.float16) * 60000.0).sum()).backward()  # 60000 x 4096 overflows float16
    scaler.unscale(opt)
    before = w.detach().clone()
    scaler.step(opt)
    assert torch.equal(w.detach(), before)  # skipped: the master weights keep every bit
    assert scaler.metrics() == {"actor/loss_scale": 2048.0, "actor/skipped_steps": 1.0}


def test_disabled_scaler_is_plain_opt_step_bit_for_bit():
    steps = []
    for use in (False, True):
        torch.manual_seed(0)
        w, opt = master_and_copy(0.3)
        scaler = LossScaler(torch.bfloat16, torch.device("cpu"))
        loss = (w.to(torch.bfloat16) ** 2).sum()
        (scaler.scale(loss) if use else loss).backward()
        if use:
            scaler.unscale(opt)
            scaler.step(opt)
        else:
            opt.step()
        steps.append(w.detach().clone())
    assert torch.equal(*steps) and scaler.metrics() == {}


def test_float16_is_a_dtype_and_a_wrong_one_is_refused_in_one_line():
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ConfigError, match=r"model.dtype='float8'.*float16"):
        make_cfg("model.dtype=float8")
    with pytest.raises(ConfigError, match="float16 is not valid with determinism.kernels=batch_invariant"):
        check_compute_dtype(torch.device("cpu"), torch.float16, invariant_kernels=True)
    check_compute_dtype(torch.device("cpu"), torch.bfloat16, invariant_kernels=True)  # bf16: bitwise, allowed


def test_float16_trains_on_cpu_under_off_with_its_loss_scale_and_mismatch_logged(tmp_path):
    cfg = make_cfg(*TINY, "model.dtype=float16", "determinism=off", "model=qwen3_moe")
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["actor/loss_scale"] > 0 and 0 <= r["actor/skipped_steps"] <= r["actor/optimizer_steps"]
        # float16 kernels differ by CPU (AVX2 vs AVX512): some give the trainer and the engine the same bits
        assert 0 <= r["mismatch/train_rollout_logprob_abs_diff"] < 1e-2
        assert 0 < r["mismatch/router_agreement"] <= 1
    assert json.loads((tmp_path / "run" / "numerics.json").read_text())["dtype"] == "torch.float16"
