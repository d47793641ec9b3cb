"""The policy-loss registry: hand-computed values, masks, gradients, and where each loss differs from vanilla."""

import math

import pytest
import torch

from detrl.algos import POLICY_LOSSES, agg_loss
from detrl.algos.policy_loss import micro_batch_seed
from detrl.algos.registry import Registry
from detrl.config import AlgoConfig, ConfigError, PolicyLossArgs

NAMES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean", "clip_cov", "kl_cov"]


def _batch(seed=0, b=4, t=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    old = logp + (torch.rand(b, t, generator=g, dtype=dtype) - 0.5) * 0.8
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=dtype)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    return logp, old, adv, mask


def test_registry_has_verls_names_and_refuses_duplicates_and_unknown_names():
    assert list(POLICY_LOSSES) == NAMES
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("gspo")(lambda *a: None)
    with pytest.raises(ValueError, match=r"algo.policy_loss='ppo' is not valid; choose one of \['vanilla'"):
        POLICY_LOSSES.get_fn("ppo")
    r = Registry("x")
    r.register("a")(len)
    assert r.get_fn("a") is len


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_has_the_shape_the_metric_keys_and_ignores_masked_tokens(name):
    logp, old, adv, mask = _batch()
    cfg = AlgoConfig(policy_loss_args=PolicyLossArgs(clip_cov_ratio=0.2, kl_cov_ratio=0.2))
    loss, m = POLICY_LOSSES[name](logp, old, adv, mask, cfg, seed=1)
    assert loss.shape == logp.shape and torch.isfinite(loss).all()
    assert set(m) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    # what masked tokens hold changes nothing the aggregated loss sees
    junk = torch.where(mask > 0, logp, torch.full_like(logp, -7.0))
    junk_old = torch.where(mask > 0, old, torch.full_like(old, 3.0))
    loss2, m2 = POLICY_LOSSES[name](junk, junk_old, adv, mask, cfg, seed=1)
    for mode in ("token-mean", "seq-mean-token-mean", "token-sum"):
        assert torch.equal(agg_loss(loss, mask, mode), agg_loss(loss2, mask, mode))
    assert all(torch.equal(m[k], m2[k]) for k in m)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "vanilla"])
def test_every_loss_differs_from_vanilla_somewhere(name):
    logp, old, adv, mask = _batch(seed=3)
    cfg = AlgoConfig(policy_loss_args=PolicyLossArgs(clip_cov_ratio=0.5, kl_cov_ratio=0.5, clip_cov_lb=-10))
    logp = logp.requires_grad_()
    van, _ = POLICY_LOSSES["vanilla"](logp, old, adv, mask, cfg)
    other, _ = POLICY_LOSSES[name](logp, old, adv, mask, cfg, seed=2)
    (g_van,) = torch.autograd.grad(agg_loss(van, mask, "seq-mean-token-mean"), logp)
    (g_oth,) = torch.autograd.grad(agg_loss(other, mask, "seq-mean-token-mean"), logp)
    assert not torch.allclose(g_van, g_oth, atol=1e-4)


def test_gspo_uses_the_sequence_ratio_and_its_gradient_is_the_sequence_objectives():
    cfg = AlgoConfig(clip_ratio_low=0.5, clip_ratio_high=0.5)  # wide: nothing clips below
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    old = torch.tensor([[-1.2, -1.9, -0.5]], dtype=torch.float64)
    adv = torch.full((1, 3), 2.0, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES["gspo"](logp, old, adv, mask, cfg)
    s = math.exp((0.2 - 0.1) / 2)  # geometric mean of the two tokens' ratios
    torch.testing.assert_close(loss[0, :2], torch.full((2,), -2.0 * s, dtype=torch.float64))

    # straight-through: the aggregated loss's gradient is that of -A * s_i (gradcheck, float64)
    def f(lp):
        return agg_loss(POLICY_LOSSES["gspo"](lp, old, adv, mask, cfg)[0], mask, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),))
    lp, o, a, m = (x.double() for x in _batch(seed=5))
    wide = AlgoConfig(clip_ratio_low=0.99, clip_ratio_high=100.0)

    def g(x):
        return agg_loss(POLICY_LOSSES["gspo"](x, o, a, m, wide)[0], m, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(g, (lp.clone().requires_grad_(),))


def test_gspo_clips_whole_sequences():
    cfg = AlgoConfig(clip_ratio_low=0.0003, clip_ratio_high=0.0004)
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.1, 0.1], [-0.1, -0.1]])  # seq 0: mean log-ratio 0 (kept); seq 1: 0.1 (clipped)
    adv, mask = torch.ones(2, 2), torch.ones(2, 2)
    loss, m = POLICY_LOSSES["gspo"](logp, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert m["pg_clipfrac"].item() == 0.5
    assert torch.equal(grad[1], torch.zeros(2)) and (grad[0] != 0).all()


def test_cispo_keeps_a_gradient_where_vanilla_clips():
    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)  # ratio 1.5 > 1.2 with A > 0
    old, adv, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    loss, m = POLICY_LOSSES["cispo"](logp, old, adv, mask, cfg)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert loss.item() == pytest.approx(-1.2 * math.log(1.5)) and g.item() == pytest.approx(-1.2)
    assert m["pg_clipfrac"].item() == 1.0
    van, _ = POLICY_LOSSES["vanilla"](logp, old, adv, mask, cfg)
    assert torch.autograd.grad(van.sum(), logp)[0].item() == 0.0


def test_sapo_gate_hand_computed():
    cfg = AlgoConfig()  # tau_pos 1.0, tau_neg 1.05
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = POLICY_LOSSES["sapo"](logp, torch.zeros(1, 2), adv, torch.ones(1, 2), cfg)
    want_pos = -(1 / (1 + math.exp(-0.5))) * 4.0
    want_neg = (1 / (1 + math.exp(1.05 * 0.5))) * 4.0 / 1.05
    torch.testing.assert_close(loss, torch.tensor([[want_pos, want_neg]]))


def test_gpg_is_plain_policy_gradient():
    logp, old, adv, mask = _batch()
    loss, _ = POLICY_LOSSES["gpg"](logp, old, adv, mask, AlgoConfig())
    assert torch.equal(loss, -logp * adv)


def test_geo_mean_hand_computed_and_clipped_pessimistically():
    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    logp = torch.tensor([[0.5, 0.1, 9.0]])  # token log-ratios 0.5 (clipped to 0.2 for A > 0), 0.1; 3rd masked
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = POLICY_LOSSES["geo_mean"](logp, torch.zeros(1, 3), torch.ones(1, 3), mask, cfg)
    want = -math.exp((0.2 + 0.1) / 2)
    torch.testing.assert_close(loss[0, :2], torch.full((2,), want), rtol=1e-6, atol=1e-6)
    assert m["pg_clipfrac"].item() == 0.5 and m["pg_clipfrac_lower"].item() == 0.0
    # A < 0: the low log-ratio side is the pessimistic one, the high side stays unclipped
    loss, m = POLICY_LOSSES["geo_mean"](logp, torch.zeros(1, 3), -torch.ones(1, 3), mask, cfg)
    torch.testing.assert_close(loss[0, 0], torch.tensor(math.exp(0.3)), rtol=1e-6, atol=1e-6)
    assert m["pg_clipfrac_lower"].item() == 0.5


def test_clip_cov_detaches_a_seeded_share_in_the_window():
    logp, old, adv, mask = _batch(seed=7, b=8, t=16)
    args = PolicyLossArgs(clip_cov_ratio=0.1, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    cfg = AlgoConfig(clip_ratio_low=0.99, clip_ratio_high=100.0, policy_loss_args=args)  # nothing clips
    a, ma = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, cfg, seed=micro_batch_seed(0, 3, 0))
    b, _ = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, cfg, seed=micro_batch_seed(0, 3, 0))
    c, _ = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, cfg, seed=micro_batch_seed(0, 4, 0))
    assert torch.equal(a, b) and not torch.equal(a, c)  # the seed picks; the same seed, the same bits
    zeroed = ((a == 0) & (mask > 0)).sum().item()
    assert zeroed == int(0.1 * mask.sum().item())
    assert ma["pg_clipfrac"].item() == pytest.approx(zeroed / mask.sum().item())


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp = torch.tensor([[-0.1, -2.0, -1.0, -3.0]])
    old = logp - 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    cfg = AlgoConfig(policy_loss_args=PolicyLossArgs(kl_cov_ratio=0.25, ppo_kl_coef=0.1))
    loss, m = POLICY_LOSSES["kl_cov"](logp, old, adv, torch.ones(1, 4), cfg)
    # cov = (A - 0) * (logp - mean logp): largest at token 3 (A=-1, logp far below the mean -1.525)
    base = -adv * math.exp(0.5)
    torch.testing.assert_close(loss, base + torch.tensor([[0.0, 0.0, 0.0, 0.05]]))
    assert m["pg_clipfrac"].item() == 0.25 and m["ppo_kl"].item() == pytest.approx(0.5)


def test_config_refuses_a_bad_policy_loss_in_one_line():
    from detrl.config import _validate_algo_variants

    with pytest.raises(
        ConfigError, match=r"^algo.policy_loss='ppo' is not valid; choose one of \[.*'kl_cov'\]$"
    ):
        _validate_algo_variants(AlgoConfig(policy_loss="ppo"))
