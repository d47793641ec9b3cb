"""Policy losses by verl's `actor.policy_loss.loss_mode` names: `POLICY_LOSSES[name](logp, old_logp, adv, mask, cfg)`.

Formulas from verl `verl/trainer/ppo/core_algos.py` @ 1dda039 (verl-project/verl, 2026-08-22; these eight
unchanged since volcengine/verl b178a3c), `register_policy_loss`; the code is detrl's own. Each function returns (per-token loss [B, T], metrics) and the caller aggregates with the one
`agg_loss` (and applies rollout-correction weights), so `algo.loss_agg_mode` acts on every loss. verl forces
`seq-mean-token-mean` inside `gspo` and `sapo` and takes a plain mean over sequences in `geo_mean`: the presets
set that mode (`algo=gspo`), and `geo_mean` returns its sequence loss on every token of the sequence, which
under `seq-mean-token-mean` is verl's mean over sequences. `cfg` is an `AlgoConfig` (clip ratios, and
`policy_loss_args` for the loss-specific knobs, verl's names). Metrics: `pg_clipfrac`, `pg_clipfrac_lower`,
`ppo_kl` for every loss (0 where a loss has no such notion), masked token means, detached.
"""

from __future__ import annotations

import torch

from detrl.algos.core import compute_policy_loss
from detrl.algos.registry import Registry

POLICY_LOSSES = Registry("algo.policy_loss")
Tensor = torch.Tensor
LossOut = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (per-token loss [B, T], metrics)
SAFETY_BOUND = 20.0  # verl's clamp on log-ratios before exp


def _mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp_min(1.0)).detach()


def _metrics(mask, log_ratio, clipfrac=None, lower=None) -> dict[str, torch.Tensor]:
    zero = torch.zeros((), dtype=mask.dtype)
    return {
        "pg_clipfrac": zero if clipfrac is None else _mean(clipfrac.to(mask.dtype), mask),
        "pg_clipfrac_lower": zero if lower is None else _mean(lower.to(mask.dtype), mask),
        "ppo_kl": _mean(-log_ratio.detach(), mask),
    }


def micro_batch_seed(seed: int, step: int, start: int) -> int:
    """A seed for a loss's own sampling (clip_cov), fixed by the run seed, the step and the micro-batch."""
    return ((seed * 1_000_003 + step) * 1_000_003 + start) % (2**63)


@POLICY_LOSSES.register("vanilla")
def vanilla(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """Clipped PPO surrogate with dual clip (verl `compute_policy_loss_vanilla`): detrl's `compute_policy_loss`."""
    return compute_policy_loss(
        logp, old_logp, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c
    )


@POLICY_LOSSES.register("gspo")
def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """GSPO (arXiv 2507.18071; verl `compute_policy_loss_gspo`): the sequence ratio
    s_i = exp(mean_t log(pi/pi_old)) on every token as s_{i,t} = sg[s_i] * pi_t / sg[pi_t] (its value s_i, its
    gradient s_i * grad log pi_t), log clamped at 10 as verl, then clipped PPO without dual clip. Aggregated
    with seq-mean-token-mean the gradient is that of -A_i * s_i: the paper's sequence objective."""
    log_ratio = logp - old_logp
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    log_s = (logp - logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    l1 = -adv * s
    l2 = -adv * s.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(l1, l2), _metrics(mask, log_ratio, clipfrac=l2 > l1)


@POLICY_LOSSES.register("cispo")
def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """CISPO (MiniMax-M1, arXiv 2506.13585; verl `compute_policy_loss_cispo`): -sg[clip(r, 1-lo, 1+hi)] * A *
    log pi. Every token keeps a gradient (the clipped weight is a constant); pg_clipfrac: r was clipped."""
    log_ratio = (logp - old_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    w = ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high).detach()
    return -w * adv * logp, _metrics(mask, log_ratio, clipfrac=ratio != w)


@POLICY_LOSSES.register("sapo")
def sapo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """SAPO (arXiv 2511.20347; verl `compute_policy_loss_sapo`): a soft gate instead of the clip,
    -f(r) * A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg."""
    p = cfg.policy_loss_args
    log_ratio = (logp - old_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, _metrics(mask, log_ratio)


@POLICY_LOSSES.register("gpg")
def gpg(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """GPG (verl `compute_policy_loss_gpg`): plain policy gradient -log pi * A, no ratio, no clip."""
    return -logp * adv, _metrics(mask, logp - old_logp)


@POLICY_LOSSES.register("geo_mean")
def geo_mean(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """GMPO (arXiv 2507.20673; verl `compute_policy_loss_geo_mean`): each token's log-ratio clipped to
    [-lo, hi] on the side the advantage's sign makes pessimistic, the sequence ratio their geometric mean,
    loss -mean_t(A) * ratio_i per sequence, here on every token of the sequence (seq-mean-token-mean gives
    verl's mean over sequences). pg_clipfrac(_lower): clipped tokens with A > 0 (A < 0)."""
    log_ratio = logp - old_logp
    sgn = torch.sign(adv)
    clamped = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    pessimistic = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    n = mask.sum(-1)
    ratio = torch.exp((pessimistic * mask).sum(-1) / (n + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (n + 1e-8)
    loss = (-seq_adv * ratio).unsqueeze(-1).expand_as(logp)
    clipped = log_ratio != clamped
    return loss, _metrics(mask, log_ratio, clipfrac=clipped & (adv > 0), lower=clipped & (adv < 0))


@POLICY_LOSSES.register("clip_cov")
def clip_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """Clip-Cov (arXiv 2505.22617; verl `compute_policy_loss_clip_cov`): the clipped surrogate, where a
    random `clip_cov_ratio` share of the (micro-)batch's tokens whose centred covariance (A - mean A) *
    (log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), among those the clip left alone, lose their
    gradient (loss 0). The draw uses a generator seeded by `seed` (see `micro_batch_seed`), so it is the
    same in every run; verl draws from the global RNG. pg_clipfrac: the share of tokens so detached."""
    p = cfg.policy_loss_args
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    on = mask > 0
    with torch.no_grad():
        cov = (adv - _mean(adv, mask)) * (logp - _mean(logp, mask))
        pick = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & on & ~(l2 > l1)
        idx = torch.nonzero(pick.flatten()).squeeze(-1)
        n = max(int(p.clip_cov_ratio * mask.sum().item()), 1)
        perm = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))
        corr = torch.ones(logp.numel(), dtype=logp.dtype, device=logp.device)
        corr[idx[perm[:n].to(idx.device)]] = 0.0
        corr = corr.view_as(logp)
    return torch.maximum(l1, l2) * corr, _metrics(mask, log_ratio, clipfrac=corr == 0)


@POLICY_LOSSES.register("kl_cov")
def kl_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg, seed: int = 0) -> LossOut:
    """KL-Cov (arXiv 2505.22617; verl `compute_policy_loss_kl_cov`): the unclipped surrogate -A * r, plus
    ppo_kl_coef * |log r| on the top `kl_cov_ratio` share of the (micro-)batch's tokens by centred covariance
    (A - mean A) * (log pi - mean log pi). ppo_kl is verl's mean |log r|; pg_clipfrac: the penalised share."""
    p = cfg.policy_loss_args
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    on = mask > 0
    with torch.no_grad():
        cov = (adv - _mean(adv, mask)) * (logp - _mean(logp, mask))
        cov = torch.where(on, cov, torch.full_like(cov, -torch.inf)).flatten()
        k = max(1, int(int(on.sum()) * p.kl_cov_ratio)) if on.any() else 0
        top = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        top[torch.topk(cov, k).indices] = True
        top = top.view_as(logp)
    loss = -adv * ratio + torch.where(top, p.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(ratio))
    m = _metrics(mask, log_ratio, clipfrac=top)
    m["ppo_kl"] = _mean(log_ratio.abs(), mask)
    return loss, m
