"""verl's actor-side knobs in collect: balance_batch's order, DAPO's gen_batch_size, NaN-metric groups."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.algos import filter_groups
from detrl.collect import _micro_slices, balanced_order
from tests.conftest import run_tiny

FP_KEYS = ["fp/params", "fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order"]
SHORT = ["steps=2", "algo.ppo_mini_batch_size=4", "micro_batch_size=12"]


def test_filter_groups_drops_a_group_whose_metric_is_nan_as_verl():
    nan = math.nan
    kept = filter_groups([1.0, 0.0, nan, 1.0, nan, nan, 0.5], [1, 1, 2, 2, 3, 3, 4])
    assert kept == [1, 4]  # 2: a NaN among values; 3: all NaN; 4: a group of one stays (verl: len == 1)
    assert filter_groups([nan], [9]) == [9]


def test_balanced_order_hand_computed():
    # one mini-batch of 6 rows in micro-batches of 3: longest first to the emptier micro-batch
    tokens = [10, 9, 8, 1, 2, 3]
    order = balanced_order(tokens, per_mini=6, micro=3)
    assert order == [0, 4, 5, 1, 2, 3]  # {10, 3, 2} = 15 and {9, 8, 1} = 18; before: 27 vs 6
    parts = [sum(tokens[i] for i in order[lo:hi]) for lo, hi in _micro_slices(6, 6, 3)]
    assert parts == [15, 18]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 12), st.integers(1, 7))
def test_balanced_order_permutes_within_mini_batches_only(tokens, per_mini, micro):
    order = balanced_order(tokens, per_mini, micro)
    assert sorted(order) == list(range(len(tokens)))
    for start in range(0, len(tokens), per_mini):  # a row never leaves its mini-batch (its optimizer step)
        assert set(order[start : start + per_mini]) == set(range(start, min(start + per_mini, len(tokens))))
    assert balanced_order(tokens, per_mini, micro) == order  # a function of the lengths


def test_balance_batch_trains_reproducibly_and_reorders(tmp_path):
    opts = [*SHORT, "algo.balance_batch=true"]
    a = run_tiny(tmp_path / "a", *opts, "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", *opts, "rollout.num_workers=3", "rollout.max_batch_size=5")
    plain = run_tiny(tmp_path / "plain", *SHORT)
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    assert [r["fp/rollout_tokens"] for r in a] == [r["fp/rollout_tokens"] for r in plain][:1] + [
        r["fp/rollout_tokens"] for r in a
    ][1:]  # the same first rollout; its order, then the weights, differ
    assert a[0]["fp/batch_order"] != plain[0]["fp/batch_order"]
    assert all(r["global_seqlen/balanced_minmax_diff"] <= r["global_seqlen/minmax_diff"] for r in a)


@pytest.mark.parametrize("gen", [24])
def test_gen_batch_size_draws_more_prompts_a_round(tmp_path, gen):
    opts = [*SHORT, "algo=dapo", "algo.ppo_mini_batch_size=4"]
    a = run_tiny(tmp_path / "a", *opts, f"algo.gen_batch_size={gen}", "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", *opts, f"algo.gen_batch_size={gen}", "rollout.num_workers=3")
    plain = run_tiny(tmp_path / "plain", *opts)
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    # step 1: prompts come in the same order and are seeded by (step, uid, sample), so the first 8 groups that
    # pass the filter are the same; the surplus is left out: the same update, from fewer, larger rounds
    assert a[0]["fp/params"] == plain[0]["fp/params"] and a[0]["dapo/kept_groups"] == 8
    assert a[0]["dapo/gen_batches"] == math.ceil(plain[0]["dapo/gen_batches"] * 8 / gen)
    assert a[0]["dapo/gen_batches"] < plain[0]["dapo/gen_batches"]  # not vacuous: plain needed > 1 round


def test_gen_batch_size_below_train_batch_size_fails_in_one_line():
    from detrl.config import ConfigError
    from tests.conftest import make_cfg

    with pytest.raises(ConfigError, match=r"^algo.gen_batch_size=4 is not valid: must be 0"):
        make_cfg("train_batch_size=8", "algo.gen_batch_size=4")
