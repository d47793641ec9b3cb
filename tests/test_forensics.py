import json
import shutil

import pytest
import torch

from conftest import read_metrics, run_tiny
from detrl.forensics import first_divergence, layer_digests, load_policy, main, make_canary

CKPT = ("checkpoint.every=1", "checkpoint.keep_last=10")
TARGET = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def on_runs(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("on_a"), tmp_path_factory.mktemp("on_b")
    run_tiny(a, "determinism=on", *CKPT)
    run_tiny(b, "determinism=on", *CKPT)
    return a, b


@pytest.fixture(scope="module")
def off_runs(tmp_path_factory):
    """Two determinism=off runs whose fp/params part. Whether and when two tiny off runs part depends
    on timing (dynamic batching); here they usually part at step 2 or 3, so B is re-run until it does."""
    a = tmp_path_factory.mktemp("off_a")
    params_a = [r["fp/params"] for r in run_tiny(a, "determinism=off", *CKPT)]
    for attempt in range(5):
        b = tmp_path_factory.mktemp(f"off_b{attempt}")
        if [r["fp/params"] for r in run_tiny(b, "determinism=off", *CKPT)] != params_a:
            return a, b
    pytest.fail("five determinism=off runs all matched run A's fp/params")


def test_off_runs_name_a_first_diverging_module_with_a_nonzero_diff(off_runs):
    a, b = off_runs
    r = first_divergence(a, b)
    assert r.diverged and r.step == r.first_differ  # every step is checkpointed
    assert r.last_agree == (r.first_differ - 1 if r.first_differ > 1 else None)
    assert r.first_fp is not None and r.first_fp[0] <= r.first_differ
    fm = r.first_module
    assert fm is not None and fm.max_abs > 0 and fm.rel_l2 > 0
    assert r.first_param is not None and r.first_param.max_abs > 0
    assert all(d.equal for d in r.modules[: r.modules.index(fm)])
    text = r.format()
    assert f"first module whose output differs: {fm.name} ({fm.op})" in text
    assert "lm_head" in text and "(model)" in text  # the table lists every module


def test_on_runs_report_no_divergence_in_one_line(on_runs, capsys):
    a, b = on_runs
    r = first_divergence(a, b)
    assert not r.diverged and r.step is None
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == "no divergence: fp/params equal at all 3 common steps (1..3)"


def test_equal_checkpoints_compared_on_request_give_zero_diffs(on_runs):
    r = first_divergence(*on_runs, step=3)
    assert r.step == 3 and r.first_param is None and r.first_module is None
    assert r.modules and all(d.equal for d in r.modules)
    assert "every module's output is bitwise equal" in r.format()


def test_a_perturbed_down_proj_is_localised_to_exactly_that_module(on_runs, tmp_path):
    a = on_runs[0]
    b = tmp_path / "b"
    shutil.copytree(a, b)
    # B differs from A from step 2 on: one weight of layer 1's down_proj (checkpoint and fingerprint)
    path = b / "checkpoints" / "step-000002" / "state.pt"
    payload = torch.load(path, weights_only=False)
    payload["model"][f"{TARGET}.weight"][3, 5] += 1e-3
    torch.save(payload, path)
    rows = read_metrics(b)
    for row in rows:
        if row["step"] >= 2:
            row["fp/params"] = "perturbed"
    (b / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    r = first_divergence(a, b)
    assert (r.last_agree, r.first_differ, r.step) == (1, 2, 2)
    assert r.first_param.name == f"{TARGET}.weight" and sum(not d.equal for d in r.params) == 1
    assert (r.first_module.name, r.first_module.op) == (TARGET, "Linear")
    assert r.first_module.max_abs > 0
    names = [d.name for d in r.modules]
    assert all(d.equal for d in r.modules[: names.index(TARGET)])  # everything before it is bitwise equal
    assert not r.modules[names.index("lm_head")].equal  # and the difference propagates

    # layer digests say the same: layer 0 equal, layer 1 not
    canary = make_canary(64)
    da, db = (layer_digests(load_policy(run, 2)[0], canary) for run in (a, b))
    assert list(da) == ["0", "1"] and da["0"] == db["0"] and da["1"] != db["1"]


def test_layer_digests_are_stable_and_leave_the_model_and_rngs_alone(on_runs):
    model, _ = load_policy(on_runs[0], 3)
    other, _ = load_policy(on_runs[1], 3)
    canary = make_canary(model.config.vocab_size, "2x8@1")
    model.train()
    rng = torch.get_rng_state()
    d = layer_digests(model, canary)
    assert model.training and torch.equal(rng, torch.get_rng_state())
    assert d == layer_digests(model, canary) == layer_digests(other, canary)
    assert all(len(v) == 16 for v in d.values())
    assert layer_digests(model, make_canary(64, "2x8@2")) != d


def test_no_checkpoint_at_or_after_the_divergence_says_what_exists(off_runs, tmp_path):
    a, b = (shutil.copytree(run, tmp_path / name) for run, name in zip(off_runs, "ab", strict=True))
    first = first_divergence(a, b).first_differ
    for p in (b / "checkpoints").glob("step-*"):
        if int(p.name.split("-")[1]) >= first:
            shutil.rmtree(p)
    text = first_divergence(a, b).format()
    assert "checkpoint.every=1 checkpoint.keep_last=" in text and "B has" in text
    # what to run instead: each run again to the first differing step (its last step is checkpointed)
    assert f"python train.py <its overrides> steps={first} run_dir={a}_to{first}" in text
    assert f"python -m detrl.forensics {a}_to{first} {b}_to{first}" in text
    (b / ".hydra").mkdir()
    (b / ".hydra" / "overrides.yaml").write_text("- determinism=off\n- steps=6\n- seed=1\n")
    assert f"python train.py determinism=off seed=1 steps={first} run_dir={b}_to{first}" in (
        first_divergence(a, b).format()
    )


def test_moe_router_perturbation_is_localised_and_routing_flips_are_counted():
    import copy

    from detrl.config import ModelConfig
    from detrl.forensics import compare_forward
    from detrl.models.build import build_model

    a = build_model(ModelConfig(name="qwen3_moe", init="random"), seed=0).eval()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.model.layers[1].mlp.gate.weight.mul_(-1.0)  # flips layer 1's expert ranking
    diffs = compare_forward(a, b, make_canary(64, "2x8@0"))
    first = next(d for d in diffs if not d.equal)
    assert first.name == "model.layers.1.mlp.gate" and first.ids_changed > 0
    assert all(d.equal for d in diffs[: diffs.index(first)])


def test_a_requested_step_without_checkpoints_says_so(on_runs):
    text = first_divergence(*on_runs, step=7).format()
    assert "comparing step 7 as asked" in text and "no checkpoint at step 7 in both runs" in text
