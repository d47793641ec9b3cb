"""Mismatch corrections and layer digests, wired into training."""

from tests.conftest import run_tiny


def test_corrections_are_exact_no_ops_under_on_and_act_under_off(tmp_path):
    plain = run_tiny(tmp_path / "plain", "algo.rollout_correction=none")
    tis = run_tiny(tmp_path / "tis", "algo.rollout_correction=tis", "algo.rollout_corr.cap=1.0")
    mis = run_tiny(
        tmp_path / "mis",
        "algo.rollout_correction=mis",
        "algo.rollout_corr.lower=1.0",
        "algo.rollout_corr.upper=1.0",
    )
    for rows in (tis, mis):  # old == rollout bitwise: every weight is exactly 1, nothing is masked
        assert [r["fp/params"] for r in rows] == [r["fp/params"] for r in plain]
        assert all(
            r["rollout_corr/weight_mean"] == 1.0 and r["rollout_corr/masked_frac"] == 0.0 for r in rows
        )
    # off: trainer and rollout logprobs differ, so the tightest MIS window [1, 1] drops tokens
    off = run_tiny(
        tmp_path / "off",
        "determinism=off",
        "algo.rollout_correction=mis",
        "algo.rollout_corr.lower=1.0",
        "algo.rollout_corr.upper=1.0",
    )
    assert any(r["mismatch/train_rollout_logprob_abs_diff"] > 0 for r in off)
    assert any(r["rollout_corr/masked_frac"] > 0 for r in off)


def test_layer_digests_every_k_steps_are_equal_across_on_runs(tmp_path):
    a = run_tiny(tmp_path / "a", "layer_digests_every=2")
    b = run_tiny(tmp_path / "b", "layer_digests_every=2")
    assert [r["fp/layers/0"] == "" for r in a] == [True, False, True]  # steps 1, 2, 3
    assert [{k: v for k, v in r.items() if k.startswith("fp/layers/")} for r in a] == [
        {k: v for k, v in r.items() if k.startswith("fp/layers/")} for r in b
    ]
    assert a[1]["fp/layers/0"] != a[1]["fp/layers/1"]
