import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.algos import (
    agg_loss,
    compute_policy_loss,
    filter_groups,
    grpo_advantages,
    kl_penalty,
    lr_ratio,
    old_logprobs,
    overlong_penalty,
    warmup_steps,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]


def test_grpo_advantages_hand_computed():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    # group 0: mean .5, unbiased std sqrt(1/3); group 1: mean 2, std sqrt(2)
    a0, a1 = 0.5 / (math.sqrt(1 / 3) + 1e-6), 1.0 / (math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([a0, -a0, -a0, a0, a1, -a1]), rtol=0, atol=1e-6)


def test_dr_grpo_drops_the_std():
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([5, 5]), norm_by_std=False)
    assert torch.equal(adv, torch.tensor([1.0, -1.0]))


def test_all_equal_rewards_and_groups_of_one_get_zero():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.7]), torch.tensor([0, 0, 0, 1]))
    assert torch.equal(adv, torch.zeros(4))


def _loss(ratio, adv, low=0.2, high=0.2, c=3.0):
    logp = torch.log(torch.tensor([[ratio]]))
    return compute_policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), low, high, c)


@pytest.mark.parametrize(
    "ratio, adv, want, clipped, dual",
    [
        (1.5, 1.0, -1.2, 1.0, 0.0),  # above 1+eps with A>0: clipped
        (0.5, 1.0, -0.5, 0.0, 0.0),  # below 1-eps with A>0: the unclipped term is the max
        (0.5, -1.0, 0.8, 1.0, 0.0),  # below 1-eps with A<0: clipped
        (1.1, -1.0, 1.1, 0.0, 0.0),  # inside the trust region
        (5.0, -1.0, 3.0, 0.0, 1.0),  # A<0, huge ratio: the dual clip caps at -A*c
    ],
)
def test_policy_loss_both_clips_and_dual_clip(ratio, adv, want, clipped, dual):
    loss, m = _loss(ratio, adv)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["pg_clipfrac"].item() == clipped
    assert m["pg_clipfrac_lower"].item() == dual
    assert m["ppo_kl"].item() == pytest.approx(-math.log(ratio), abs=1e-6)


def test_clip_higher_is_asymmetric():
    loss, _ = _loss(1.25, 1.0, low=0.2, high=0.28)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)  # inside [0.8, 1.28]: not clipped


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last row is fully masked


@pytest.mark.parametrize(
    "mode, want",
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-mean", (6 / (3 + 1e-8) + 4 / (1 + 1e-8)) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
        (
            "seq-mean-token-sum-norm",
            (6 + 4) / 2 / 3,
        ),  # seq-mean-token-sum / loss_scale_factor (default T = 3)
        ("token-sum", 10.0),
        ("token-sum-norm", 10 / 3),  # Σ token sums / loss_scale_factor: no / sequences (verl until b178a3c)
    ],
)
def test_agg_loss_hand_computed_and_masked_rows_excluded(mode, want):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(want, abs=1e-6)


def _verl_agg_loss(
    loss_mat,
    loss_mask,
    mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's core_algos.agg_loss (verl-project/verl 1dda039), transcribed for the comparison."""

    def masked_sum(x, m):
        return (x * m).sum()

    if mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    # token-sum-norm: verl's seq-mean-token-sum-norm at volcengine/verl b178a3c
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return torch.sum(seq_losses) / loss_scale_factor


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
    st.sampled_from([*MODES, "token-sum-norm"]),
    st.booleans(),
    st.integers(1, 40),
)
def test_agg_loss_equals_verls_with_and_without_global_batch_info(b, t, seed, mode, glob, factor):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[0, 0] = 1.0  # at least one token (verl divides by 0 otherwise)
    info = (
        dict(batch_num_tokens=mask.sum().item() + 3, global_batch_size=b + 2, loss_scale_factor=factor)
        if glob
        else {}
    )
    ours, theirs = agg_loss(loss, mask, mode, **info), _verl_agg_loss(loss, mask, mode, **info)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-12)


def test_seq_mean_token_sum_norm_is_a_mean_over_sequences_and_token_sum_norm_is_not():
    for mode, want_four in (("seq-mean-token-sum-norm", 1.0), ("token-sum-norm", 4.0), ("token-sum", 16.0)):
        one = agg_loss(torch.ones(1, 4), torch.ones(1, 4), mode, loss_scale_factor=4)
        four = agg_loss(torch.ones(4, 4), torch.ones(4, 4), mode, loss_scale_factor=4)
        assert (one.item(), four.item()) == (4.0 if mode == "token-sum" else 1.0, want_four), mode


def test_unknown_agg_mode_names_the_value():
    with pytest.raises(ValueError, match="loss_agg_mode='avg'"):
        agg_loss(LOSS, MASK, "avg")


def test_kl_estimators_hand_computed():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    ln2 = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(ln2, abs=1e-6)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(ln2, abs=1e-6)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2, abs=1e-6)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1, abs=1e-6)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-100.0]), "low_var_kl").item() <= 10.0  # clamped
    with pytest.raises(ValueError, match="kl_loss_type='k9'"):
        kl_penalty(logp, ref, "k9")


def test_filter_groups_keeps_mixed_and_singletons_in_first_seen_order():
    assert filter_groups([1, 1, 0, 1, 0.5, 0, 0], [4, 4, 2, 2, 9, 3, 3]) == [2, 9]


def test_overlong_penalty_is_linear_in_the_buffer():
    pen = overlong_penalty(torch.tensor([1, 6, 7, 8, 10]), max_len=10, buffer_len=4, factor=2.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0]))
    assert torch.equal(overlong_penalty(torch.tensor([10]), 10, 0, 1.0), torch.zeros(1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12), st.integers(1, 4))
def test_group_advantages_sum_to_zero(scores, groups):
    s = torch.tensor(scores, dtype=torch.float64)
    g = torch.arange(len(scores)) % groups
    adv = grpo_advantages(s, g)
    for k in range(groups):
        assert abs(adv[g == k].sum().item()) < 1e-6


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from(MODES), st.data())
def test_micro_batches_with_global_denominators_sum_to_the_full_loss(b, t, seed, mode, data):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    split = data.draw(st.integers(1, b - 1))
    glob = dict(batch_num_tokens=mask.sum(), global_batch_size=(mask.sum(-1) > 0).sum(), loss_scale_factor=t)
    parts = agg_loss(loss[:split], mask[:split], mode, **glob) + agg_loss(
        loss[split:], mask[split:], mode, **glob
    )
    assert parts.item() == pytest.approx(agg_loss(loss, mask, mode).item(), abs=1e-9)


def test_old_logprobs_by_stale_token_mode():
    trainer, rollout = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.5, -3.5]])
    fresh, mask = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    old, m = old_logprobs("keep", trainer, rollout, fresh, mask)
    assert old.tolist() == [[-1.0, -2.5, -3.5]] and torch.equal(m, mask)  # stale: the behaviour policy's
    old, m = old_logprobs("rescore", trainer, rollout, fresh, mask)
    assert torch.equal(old, trainer) and torch.equal(m, mask)  # stale: re-scored by the current weights
    old, m = old_logprobs("mask", trainer, rollout, fresh, mask)
    assert torch.equal(old, trainer) and m.tolist() == [[1.0, 0.0, 0.0]]  # stale: out of the loss
    with pytest.raises(ValueError, match="stale_tokens='drop'"):
        old_logprobs("drop", trainer, rollout, fresh, mask)


def _verl_cosine(step, warmup, total, min_lr_ratio=0.0, num_cycles=0.5):
    """verl's get_cosine_schedule_with_warmup lr_lambda (init_lr_ratio None)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def test_lr_schedules_match_verl():
    assert [lr_ratio(s, 10, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_ratio(0, 10, 0) == 1.0  # no warmup: the first step has the full lr
    for s in range(12):
        assert lr_ratio(s, 10, 3, "cosine", 0.1) == _verl_cosine(s, 3, 10, 0.1)
    assert lr_ratio(10, 10, 0, "cosine", 0.1) == pytest.approx(0.1)  # the floor at the end
    assert warmup_steps(-1, 0.25, 60) == 15 and warmup_steps(3, 0.25, 60) == 3


@settings(max_examples=100, deadline=None)
@given(st.floats(-30, 30), st.floats(-30, 30))
def test_k3_is_non_negative(a, b):
    assert kl_penalty(torch.tensor([a]), torch.tensor([b]), "k3").item() >= 0.0
