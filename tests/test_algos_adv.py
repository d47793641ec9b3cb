"""Advantage estimators, scale_rewards, KL '+' names and KL in the reward: hand-computed and property tests."""

import math

import pytest
import torch

from detrl.algos import ADV_ESTIMATORS, grpo_advantages, kl_penalty, token_rewards
from detrl.algos.advantages import StepAdvantages, masked_whiten
from detrl.algos.core import KL_TYPES
from detrl.algos.kl import kl_in_reward, next_kl_coef
from detrl.config import AlgoConfig, ConfigError, KLCtrlConfig, _validate_algo_variants

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
MASK = torch.tensor([[1.0, 1.0, 0.0]] * 3 + [[1.0, 0.0, 0.0]] + [[1.0, 1.0, 1.0]] * 2)


def _adv(name, scores=SCORES, groups=GROUPS, mask=MASK, **kw):
    return ADV_ESTIMATORS[name](token_rewards(scores, mask), mask, groups, AlgoConfig(**kw))


def test_registry_has_verls_names_and_a_bad_name_fails_in_one_line():
    assert {
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "gpg",
        "grpo_passk",
    } == set(ADV_ESTIMATORS)
    with pytest.raises(ConfigError, match=r"^algo.adv_estimator='gae' is not valid; choose one of \['grpo'"):
        _validate_algo_variants(AlgoConfig(adv_estimator="gae"))


def test_token_rewards_put_the_score_on_the_last_response_token():
    r = token_rewards(torch.tensor([2.0, -1.0]), torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(r, torch.tensor([[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_gives_token_advantages_and_differs_from_grpo(name):
    adv = _adv(name)
    assert adv.shape == MASK.shape and torch.isfinite(adv).all()
    if name != "grpo":
        assert not torch.allclose(adv * MASK, _adv("grpo") * MASK, atol=1e-3)


def test_grpo_is_detrls_grpo_advantages_bit_for_bit():
    assert torch.equal(_adv("grpo")[:, 0], grpo_advantages(SCORES, GROUPS))
    assert torch.equal(_adv("grpo", norm_adv_by_std=False)[:, 0], grpo_advantages(SCORES, GROUPS, False))


def test_scale_rewards_batch_and_none_follow_trl():
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    torch.testing.assert_close(_adv("grpo", scale_rewards="none")[:, 0], centred)
    want = centred / (SCORES.std() + 1e-6)
    torch.testing.assert_close(_adv("grpo", scale_rewards="batch")[:, 0], want)
    with pytest.raises(ConfigError, match="norm_adv_by_std=false already means none"):
        _validate_algo_variants(AlgoConfig(scale_rewards="batch", norm_adv_by_std=False))


def test_rloo_is_the_leave_one_out_baseline():
    adv = _adv("rloo")[:, 0]
    # group 0: r_i - mean of the other three; group 1: 3 - 1, 1 - 3
    want = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 2.0, -2.0])
    torch.testing.assert_close(adv, want)


def test_opo_uses_the_length_weighted_baseline():
    adv = _adv("opo")[:, 0]
    b0 = (2 * 1 + 2 * 0 + 2 * 0 + 1 * 1) / 7  # lengths 2, 2, 2, 1
    want = torch.tensor([1 - b0, -b0, -b0, 1 - b0, 1.0, -1.0])
    torch.testing.assert_close(adv, want)


def test_gpg_scales_by_batch_over_nonzero():
    adv = _adv("gpg")[:, 0]
    alpha = 6 / 4  # four non-zero rewards
    torch.testing.assert_close(adv, alpha * torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0]))


def test_grpo_passk_rewards_only_each_groups_best():
    adv = _adv("grpo_passk", norm_adv_by_std=False)[:, 0]
    # group 0: best 1 (first of the two), second best 1 -> gap 0; group 1: 3 - 1
    assert torch.equal(adv, torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, 0.0]))
    adv = _adv("grpo_passk")[:, 0]
    assert adv[4].item() == pytest.approx(2.0 / (math.sqrt(2.0) + 1e-6))
    with pytest.raises(ValueError, match="groups of >= 2"):
        _adv("grpo_passk", groups=torch.tensor([0, 0, 0, 0, 1, 2]))


def test_reinforce_plus_plus_whitens_discounted_returns_over_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = token_rewards(torch.tensor([1.0, 0.0]), mask)
    adv = ADV_ESTIMATORS["reinforce_plus_plus"](rewards, mask, torch.tensor([0, 0]), AlgoConfig(gamma=0.5))
    returns = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0]])  # gamma^k on the response, reset after it
    torch.testing.assert_close(adv, masked_whiten(returns, mask) * mask)
    on = adv[mask > 0]
    assert on.mean().abs().item() < 1e-6 and on.std().item() == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(adv[0, 2], torch.tensor(0.0))


def test_reinforce_plus_plus_baseline_is_group_centred_then_whitened():
    adv = _adv("reinforce_plus_plus_baseline")
    on = adv[MASK > 0]
    assert on.mean().abs().item() < 1e-6 and on.std().item() == pytest.approx(1.0, abs=1e-3)
    assert (adv[0, :2] > 0).all() and (adv[1, :2] < 0).all() and adv[0, 2] == 0  # signs of r - mean_g; mask


def test_kl_plus_names_keep_the_base_value_and_take_k2s_gradient():
    logp = torch.tensor([-0.3, -1.0, -2.5], requires_grad=True)
    ref = torch.tensor([-0.9, -0.2, -2.4])
    (g2,) = torch.autograd.grad(kl_penalty(logp, ref, "k2").sum(), logp)
    for base in ("kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"):
        plus = kl_penalty(logp, ref, base + "+")
        assert torch.equal(plus, kl_penalty(logp, ref, base))
        (g,) = torch.autograd.grad(plus.sum(), logp)
        assert torch.equal(g, g2)
    (g3,) = torch.autograd.grad(kl_penalty(logp, ref, "k3").sum(), logp)
    assert not torch.equal(g3, g2)  # so k3+ is a different gradient from k3
    assert "low_var_kl+" in KL_TYPES and "k3+" in KL_TYPES
    with pytest.raises(ValueError, match=r"kl_loss_type='k4\+' is not valid; choose one of"):
        kl_penalty(logp, ref, "k4+")


def test_kl_in_reward_and_the_controllers():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 5.0], [-0.5, 9.0, 9.0]])
    rewards = token_rewards(torch.tensor([1.0, 0.0]), mask)
    out, kl = kl_in_reward(rewards, old, ref, mask, "kl", beta=0.1)
    kld = torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(out, rewards - 0.1 * kld)
    assert kl == pytest.approx(((0.5 - 1.0) / 2 + 0.0) / 2)
    assert next_kl_coef("fixed", 0.1, 5.0, 0.1, 100, 10) == 0.1
    assert next_kl_coef("adaptive", 0.1, 0.2, 0.1, 100, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    assert next_kl_coef("adaptive", 0.1, 0.09, 0.1, 100, 10) == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))


def test_step_advantages_with_kl_in_reward_lower_the_high_kl_sequence():
    mask = torch.ones(2, 2)
    old, ref = torch.tensor([[0.0, 0.0], [-3.0, -3.0]]), torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])
    cfg = AlgoConfig(use_kl_in_reward=True, kl_ctrl=KLCtrlConfig(type="adaptive", kl_coef=0.5))
    step = StepAdvantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, kl_coef=0.5)
    adv = step(old, ref)  # equal scores, but sequence 0 is 2 nats per token off the reference
    assert adv[0, 0] < 0 < adv[1, 0]
    assert step.metrics["actor/reward_kl_penalty"] == pytest.approx(1.0)
    assert step.next_kl_coef > 0.5  # KL above target 0.1: beta grows
    off = StepAdvantages(AlgoConfig(), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, kl_coef=0.5)
    assert torch.equal(off(old, ref), torch.zeros(2, 2)) and off.metrics == {}
