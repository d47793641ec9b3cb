import math

import pytest
import torch

from detrl.algos.rollout_correction import merge_metrics, rollout_correction, validate

E = math.e
# log r = old - rollout per token: [[1, -0.5, ln 3, pad], [ln 0.4, 0, ln 1.5, ln 6]]
OLD = torch.tensor([[0.0, 0.0, math.log(3.0), 9.0], [math.log(0.4), -1.0, math.log(1.5), math.log(6.0)]])
ROLL = torch.tensor([[-1.0, 0.5, 0.0, -9.0], [0.0, -1.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
RATIO = torch.tensor([[E, math.exp(-0.5), 3.0, 1.0], [0.4, 1.0, 1.5, 6.0]])


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_tis_token_weights_are_the_ratio_capped_and_detached():
    old = OLD.clone().requires_grad_(True)
    w, mask, m = rollout_correction(old, ROLL, MASK, "tis", cap=2.0)
    assert not w.requires_grad and mask is MASK
    close(w, [[2.0, math.exp(-0.5), 2.0, 1.0], [0.4, 1.0, 1.5, 2.0]])  # pad token: weight 1
    close(m["rollout_corr/truncated_frac"], 3 / 7)  # e, 3, 6 over the 7 mask tokens
    close(m["rollout_corr/masked_frac"], 0.0)
    close(m["rollout_corr/weight_max"], 2.0)
    close(m["rollout_corr/weight_mean"], (2 + math.exp(-0.5) + 2 + 0.4 + 1 + 1.5 + 2) / 7)
    close(m["rollout_corr/ratio_max"], 6.0)
    close(m["rollout_corr/ratio_min"], 0.4)


def test_tis_sequence_level_one_capped_weight_per_sequence():
    # sequence ratios: e * e^-0.5 * 3 = 4.946 (the pad token's log-ratio is not summed); 0.4 * 1 * 1.5 * 6 = 3.6
    w, _, m = rollout_correction(OLD, ROLL, MASK, "tis", level="sequence", cap=4.0)
    close(w, [[4.0, 4.0, 4.0, 1.0], [3.6, 3.6, 3.6, 3.6]])
    close(m["rollout_corr/truncated_frac"], 3 / 7)
    close(m["rollout_corr/ratio_max"], math.exp(1 - 0.5 + math.log(3.0)))


def test_mis_token_icepop_keeps_the_ratio_inside_and_drops_outside():
    w, mask, m = rollout_correction(OLD, ROLL, MASK, "mis", lower=0.5, upper=2.0)
    assert mask is MASK  # dropped tokens weigh 0 and stay in the loss mask (its denominators count them)
    close(w, [[0.0, math.exp(-0.5), 0.0, 1.0], [0.0, 1.0, 1.5, 0.0]])
    close(m["rollout_corr/masked_frac"], 4 / 7)
    close(m["rollout_corr/truncated_frac"], 0.0)
    w1, mask1, _ = rollout_correction(OLD, ROLL, MASK, "mis", lower=0.5, upper=2.0, mis_weight="one")
    assert mask1 is MASK
    close(w1, [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])


def test_mis_bounds_are_inclusive():
    old, roll, mask = torch.tensor([[math.log(0.5), math.log(2.0)]]), torch.zeros(1, 2), torch.ones(1, 2)
    r = torch.exp(old)
    w, _, _ = rollout_correction(old, roll, mask, "mis", lower=float(r[0, 0]), upper=float(r[0, 1]))
    assert torch.equal(w, r)


def test_mis_sequence_level_drops_whole_sequences():
    w, mask, m = rollout_correction(OLD, ROLL, MASK, "mis", level="sequence", lower=0.5, upper=5.0)
    s0, s1 = math.exp(1 - 0.5 + math.log(3.0)), 0.4 * 1.0 * 1.5 * 6.0  # 4.95 kept, 3.6 kept
    close(mask, MASK)
    close(w, [[s0, s0, s0, 1.0], [s1, s1, s1, s1]])
    w, mask, m = rollout_correction(OLD, ROLL, MASK, "mis", level="sequence", lower=0.5, upper=4.0)
    close(w, [[0.0, 0.0, 0.0, 1.0], [s1, s1, s1, s1]])
    close(m["rollout_corr/masked_frac"], 3 / 7)


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mis_weight", ["ratio", "one"])
def test_exact_no_op_when_trainer_and_rollout_agree_bitwise(mode, level, mis_weight):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g) * 3
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    pg = torch.randn(5, 7, generator=g)
    w, out_mask, m = rollout_correction(
        logp,
        logp.clone(),
        mask,
        mode,
        level=level,
        cap=1.0,
        lower=1.0,
        upper=1.0,
        mis_weight=mis_weight,
        rollout_rs="token_k1,seq_sum_k1,seq_mean_k3,seq_max_k2,token_k2",
        rollout_rs_threshold="1.0_1.0,1.0_1.0,1e-9,1e-9,1e-9",
        rollout_is_batch_normalize=True,
    )
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(out_mask, mask)
    assert torch.equal(pg * w, pg)  # the policy loss is unchanged bit for bit
    assert float(m["rollout_corr/masked_frac"]) == 0.0 and float(m["rollout_corr/truncated_frac"]) == 0.0
    assert float(m["rollout_corr/rejected_frac"]) == 0.0
    assert float(m["rollout_corr/weight_mean"]) == 1.0 and float(m["rollout_corr/ratio_max"]) == 1.0


def test_none_leaves_everything_but_still_measures():
    w, mask, m = rollout_correction(OLD, ROLL, MASK, "none")
    assert torch.equal(w, torch.ones_like(w)) and mask is MASK
    close(m["rollout_corr/ratio_max"], 6.0)
    close(m["rollout_corr/weight_mean"], 1.0)


def test_merge_metrics_weights_by_tokens_and_takes_extremes():
    a = rollout_correction(OLD[:1], ROLL[:1], MASK[:1], "tis", cap=2.0)[2]
    b = rollout_correction(OLD[1:], ROLL[1:], MASK[1:], "tis", cap=2.0)[2]
    whole = rollout_correction(OLD, ROLL, MASK, "tis", cap=2.0)[2]
    merged = merge_metrics([(a, 3.0), (b, 4.0)])
    for k, v in whole.items():
        assert merged[k] == pytest.approx(float(v), rel=1e-6), k


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (
            {"mode": "icepop"},
            r"rollout_correction.mode='icepop' is not valid; choose one of \['none', 'tis', 'mis'\]",
        ),
        ({"level": "seq"}, "rollout_correction.level='seq'"),
        ({"cap": 0.5}, "cap must be >= 1"),
        ({"lower": 0.0}, r"lower bound must be in \(0, 1\]"),
        ({"upper": 0.9}, "upper bound must be >= 1"),
        ({"mis_weight": "k"}, "mis_weight='k'"),
    ],
)
def test_validation_names_the_setting(kw, msg):
    with pytest.raises(ValueError, match=msg):
        validate(**kw)


# per-token log-ratios l = OLD - ROLL on the mask: [[1, -0.5, ln 3], [ln 0.4, 0, ln 1.5, ln 6]]
L = torch.tensor([[1.0, -0.5, math.log(3.0), 0.0], [math.log(0.4), 0.0, math.log(1.5), math.log(6.0)]])


def test_rejection_token_k1_bounds_one_over_the_ratio_as_verl():
    _, mask, m = rollout_correction(OLD, ROLL, MASK, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    keep = ((-L >= math.log(0.5)) & (-L <= math.log(2.0))).float() * MASK
    assert torch.equal(mask, keep)
    close(mask, [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    close(m["rollout_corr/rejected_frac"], 4 / 7)
    close(m["rollout_corr/rejected_seq_frac"], 1.0)
    # a single value u means [1/u, u]
    assert torch.equal(
        rollout_correction(OLD, ROLL, MASK, rollout_rs="token_k1", rollout_rs_threshold="2.0")[1], mask
    )


def test_rejection_sequence_filters_and_chains():
    k2 = 0.5 * L.square() * MASK
    k3 = (torch.exp(L) - 1 - L) * MASK
    seq_sum_k1 = (-L * MASK).sum(-1)  # [-(0.5 + ln 3), -(ln 0.4 + ln 1.5 + ln 6)]
    cases = {
        ("seq_sum_k1", "0.25_1.0"): (seq_sum_k1 >= math.log(0.25)) & (seq_sum_k1 <= 0.0),
        ("seq_mean_k2", "0.45"): k2.sum(-1) / MASK.sum(-1) <= 0.45,
        ("seq_max_k3", "1.0"): k3.amax(-1) <= 1.0,
        ("seq_sum_k3", "2.0"): k3.sum(-1) <= 2.0,
    }
    for (rs, th), seq_keep in cases.items():
        _, mask, _ = rollout_correction(OLD, ROLL, MASK, rollout_rs=rs, rollout_rs_threshold=th)
        assert torch.equal(mask, MASK * seq_keep.float().unsqueeze(-1)), rs
        assert int(seq_keep.sum()) == 1, rs  # each case keeps one sequence and drops the other
    # a chain keeps what every filter keeps; per-filter thresholds
    _, chain, _ = rollout_correction(
        OLD, ROLL, MASK, rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.5,1.0"
    )
    want = MASK * (k2 <= 0.5).float() * (k3.amax(-1) <= 1.0).float().unsqueeze(-1)
    assert torch.equal(chain, want) and chain.sum() > 0


def test_rejection_clamps_each_tokens_log_ratio_before_summing():
    old = torch.tensor([[30.0, -25.0, 0.0]])  # log-ratios 30, -25: clamped to 20, -20 before the sum (0)
    _, mask, _ = rollout_correction(
        old, torch.zeros(1, 3), torch.ones(1, 3), rollout_rs="seq_sum_k1", rollout_rs_threshold="0.9_1.1"
    )
    assert torch.equal(mask, torch.ones(1, 3))  # unclamped the sum would be 5: rejected


def test_rejected_tokens_leave_the_loss_denominators_unlike_mis():
    from detrl.algos import agg_loss

    pg = torch.arange(8.0).view(2, 4)
    _, rs_mask, _ = rollout_correction(OLD, ROLL, MASK, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    w, mis_mask, _ = rollout_correction(OLD, ROLL, MASK, "mis", lower=0.5, upper=2.0, mis_weight="one")
    assert torch.equal(w * MASK, rs_mask)  # the same tokens survive
    rs = agg_loss(pg, rs_mask, "token-mean")
    mis = agg_loss(pg * w, mis_mask, "token-mean")
    assert rs.item() == pytest.approx((1 + 5 + 6) / 3) and mis.item() == pytest.approx((1 + 5 + 6) / 7)


def test_batch_normalised_weights_average_one():
    w, mask, _ = rollout_correction(OLD, ROLL, MASK, "tis", cap=2.0, rollout_is_batch_normalize=True)
    close((w * mask).sum() / mask.sum(), 1.0)
    w0, _, _ = rollout_correction(OLD, ROLL, MASK, "tis", cap=2.0)
    torch.testing.assert_close(w * MASK, w0 * MASK / ((w0 * MASK).sum() / MASK.sum()))
    ws, _, _ = rollout_correction(
        OLD, ROLL, MASK, "tis", level="sequence", cap=4.0, rollout_is_batch_normalize=True
    )
    close((ws[0, 0] + ws[1, 0]) / 2, 1.0)  # one weight per sequence, mean over sequences


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"rollout_rs": "token_k4"}, "rollout_rs='token_k4' is not valid; choose a comma-separated chain of"),
        ({"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "1,2,3"}, "give 1 or 2 thresholds"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "1.5_2.0"}, "k1 needs 0 < lower <= 1 <= upper"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"}, "k2 / k3 one upper bound"),
    ],
)
def test_rejection_validation_is_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        validate(**kw, prefix="algo.rollout_corr")
    assert "\n" not in str(e.value) and str(e.value).startswith("algo.rollout_corr.")
