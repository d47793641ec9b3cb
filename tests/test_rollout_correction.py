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
    close(mask, [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    close(w, [[0.0, math.exp(-0.5), 0.0, 1.0], [0.0, 1.0, 1.5, 0.0]])
    close(m["rollout_corr/masked_frac"], 4 / 7)
    close(m["rollout_corr/truncated_frac"], 0.0)
    w1, mask1, _ = rollout_correction(OLD, ROLL, MASK, "mis", lower=0.5, upper=2.0, mis_weight="one")
    assert torch.equal(mask1, mask)
    close(w1, [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])


def test_mis_bounds_are_inclusive():
    old, roll, mask = torch.tensor([[math.log(0.5), math.log(2.0)]]), torch.zeros(1, 2), torch.ones(1, 2)
    r = torch.exp(old)
    _, keep, _ = rollout_correction(old, roll, mask, "mis", lower=float(r[0, 0]), upper=float(r[0, 1]))
    assert torch.equal(keep, mask)


def test_mis_sequence_level_drops_whole_sequences():
    w, mask, m = rollout_correction(OLD, ROLL, MASK, "mis", level="sequence", lower=0.5, upper=5.0)
    s0, s1 = math.exp(1 - 0.5 + math.log(3.0)), 0.4 * 1.0 * 1.5 * 6.0  # 4.95 kept, 3.6 kept
    close(mask, MASK)
    close(w, [[s0, s0, s0, 1.0], [s1, s1, s1, s1]])
    _, mask, m = rollout_correction(OLD, ROLL, MASK, "mis", level="sequence", lower=0.5, upper=4.0)
    close(mask, [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
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
        logp, logp.clone(), mask, mode, level=level, cap=1.0, lower=1.0, upper=1.0, mis_weight=mis_weight
    )
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(out_mask, mask)
    assert torch.equal(pg * w, pg)  # the policy loss is unchanged bit for bit
    assert float(m["rollout_corr/masked_frac"]) == 0.0 and float(m["rollout_corr/truncated_frac"]) == 0.0
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
