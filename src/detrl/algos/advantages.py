"""Advantage estimators by verl's `algorithm.adv_estimator` names: `ADV_ESTIMATORS[name](rewards, mask, groups, cfg)`.

Formulas from verl `verl/trainer/ppo/core_algos.py` @ 1dda039 (verl-project/verl, `register_adv_est`) and, for `scale_rewards`,
TRL `trl/trainer/grpo_trainer.py` @ f2cd577 (`_generate_and_score_completions`); the code is detrl's own.
Every estimator takes token-level rewards [N, T] (the task reward on each sequence's last response token, minus
the in-reward KL when `algo.use_kl_in_reward`), the response mask [N, T], the prompt-group id of each sequence
[N] and the `AlgoConfig`, and returns token advantages [N, T] (values off the mask are not used). Outcome
estimators sum the rewards over tokens, as verl. One deviation kept from detrl's GRPO: a group of one gets
advantage 0 in `grpo` (verl: its raw score).
"""

from __future__ import annotations

import torch

from detrl.algos.registry import Registry

ADV_ESTIMATORS = Registry("algo.adv_estimator")
SCALE_REWARDS = ("group", "batch", "none")


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """Group-normalised outcome advantages, one scalar per sequence.

    A_i = (r_i - mean_g) / (std_g + eps) with the unbiased std; Dr. GRPO (norm_by_std=False) drops the
    division. A group of one gets 0: a lone sample has no baseline.

    >>> grpo_advantages(torch.tensor([1., 0., 0., 1.]), torch.tensor([0, 0, 0, 0]))
    tensor([ 0.8660, -0.8660, -0.8660,  0.8660])
    """
    adv = torch.zeros_like(scores)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = scores[idx]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=True) + epsilon) if norm_by_std else centred
    return adv


def scale_rewards_mode(cfg) -> str:
    """TRL's scale_rewards: `algo.scale_rewards`, with `algo.norm_adv_by_std=false` (Dr. GRPO) meaning none."""
    return cfg.scale_rewards if cfg.norm_adv_by_std else "none"


def _groups(group_ids: torch.Tensor) -> list[torch.Tensor]:
    return [group_ids == g for g in torch.unique(group_ids)]


def _tokens(seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return seq.unsqueeze(-1).expand_as(mask)


@ADV_ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """GRPO (verl `compute_grpo_outcome_advantage`); `scale_rewards=group` divides by the group's std (verl,
    TRL's default), `batch` by the std over the batch (TRL, following "Tricks or Traps", arXiv 2508.08221),
    `none` not at all (Dr. GRPO, verl's norm_adv_by_std_in_grpo=False)."""
    scores = rewards.sum(-1)
    mode = scale_rewards_mode(cfg)
    adv = grpo_advantages(scores, group_ids, mode == "group", cfg.adv_epsilon)
    if mode == "batch":
        adv = adv / (scores.std(unbiased=True) + cfg.adv_epsilon) if scores.numel() > 1 else adv
    return _tokens(adv, mask)


@ADV_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """RLOO (arXiv 2402.14740; verl `compute_rloo_outcome_advantage`): r_i minus the mean of the group's
    other rewards, n/(n-1) (r_i - mean_g); a group of one keeps its raw reward, as verl."""
    scores = rewards.sum(-1)
    adv = scores.clone()
    for idx in _groups(group_ids):
        n = int(idx.sum())
        if n > 1:
            adv[idx] = scores[idx] * n / (n - 1) - scores[idx].mean() * n / (n - 1)
    return _tokens(adv, mask)


@ADV_ESTIMATORS.register("opo")
def opo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """OPO (arXiv 2505.23585; verl `compute_opo_outcome_advantage`): r_i minus the length-weighted group
    baseline sum_j |y_j| r_j / sum_j |y_j| (0 for a group of one)."""
    scores, lengths = rewards.sum(-1), mask.sum(-1)
    adv = scores.clone()
    for idx in _groups(group_ids):
        if int(idx.sum()) > 1:
            adv[idx] = scores[idx] - (lengths[idx] * scores[idx]).sum() / lengths[idx].sum()
    return _tokens(adv, mask)


@ADV_ESTIMATORS.register("gpg")
def gpg(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """GPG (arXiv 2504.02546; verl `compute_gpg_outcome_advantage`, f_norm 1): alpha (r_i - mean_g) with
    alpha = batch size / number of non-zero rewards (at least 1)."""
    scores = rewards.sum(-1)
    alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1)
    adv = scores.clone()
    for idx in _groups(group_ids):
        adv[idx] = alpha * (scores[idx] - (scores[idx].mean() if int(idx.sum()) > 1 else 0.0))
    return _tokens(adv, mask)


@ADV_ESTIMATORS.register("grpo_passk")
def grpo_passk(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg) -> torch.Tensor:
    """Pass@k (arXiv 2503.19595; verl `compute_grpo_passk_outcome_advantage`): only each group's best
    response gets an advantage, r_max - r_second, divided by the group's std (+eps) when norm_adv_by_std.
    Ties: the first best (verl: torch.topk's choice)."""
    scores = rewards.sum(-1)
    adv = torch.zeros_like(scores)
    for idx in _groups(group_ids):
        r = scores[idx]
        if r.numel() < 2:
            raise ValueError(f"algo.adv_estimator=grpo_passk needs groups of >= 2 samples, got {r.numel()}")
        best = int(torch.argmax(r))
        gap = r[best] - torch.topk(r, 2).values[1]
        if cfg.norm_adv_by_std:
            gap = gap / (r.std(unbiased=True) + cfg.adv_epsilon)
        adv[torch.nonzero(idx).squeeze(-1)[best]] = gap
    return _tokens(adv, mask)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the mask's tokens, unbiased var (verl `verl_F.masked_whiten`)."""
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = ((values - mean).square() * mask).sum() / n * (n / (n - 1).clamp_min(1.0))
    return (values - mean) * torch.rsqrt(var + 1e-8)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg
) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262; verl `compute_reinforce_plus_plus_outcome_advantage`): discounted
    returns-to-go (gamma = `algo.gamma`), whitened over the batch's tokens. As verl since b178a3c, positions
    off the mask carry the running return through unchanged (multi-turn observation spans) and get 0."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        new = rewards[:, t] + cfg.gamma * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, mask) * mask


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, cfg
) -> torch.Tensor:
    """REINFORCE++-baseline (verl `compute_reinforce_plus_plus_baseline_outcome_advantage`): r_i minus the
    group mean (0 for a group of one), on every token, whitened over the batch's tokens."""
    scores = rewards.sum(-1)
    adv = scores.clone()
    for idx in _groups(group_ids):
        if int(idx.sum()) > 1:
            adv[idx] = scores[idx] - scores[idx].mean()
    return masked_whiten(_tokens(adv, mask) * mask, mask) * mask


def token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's reward on its last response token, 0 elsewhere (verl's token_level_scores) [N, T]."""
    out = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = scores[has].to(out.dtype)
    return out


class StepAdvantages:
    """One step's advantages, computed when the trainer has the old and reference logprobs (the in-reward KL
    needs them; verl's `apply_kl_penalty` then `compute_advantage`). Call with (old [N, T], ref [N, T] or None);
    afterwards `value` holds the advantages, `next_kl_coef` the controller's next beta, `metrics` verl's
    `actor/reward_kl_penalty{,_coeff}` (only with `algo.use_kl_in_reward`)."""

    def __init__(
        self, cfg, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, kl_coef: float
    ):
        self.cfg, self.scores, self.group_ids, self.mask = cfg, scores, group_ids, mask
        self.kl_coef = self.next_kl_coef = kl_coef
        self.value: torch.Tensor | None = None
        self.metrics: dict[str, float] = {}

    def __call__(self, old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        from detrl.algos.kl import kl_in_reward, next_kl_coef

        cfg, mask = self.cfg, self.mask
        rewards = token_rewards(self.scores, mask)
        if cfg.use_kl_in_reward:
            rewards, kl = kl_in_reward(rewards, old_logp, ref_logp, mask, cfg.kl_penalty, self.kl_coef)
            c = cfg.kl_ctrl
            self.next_kl_coef = next_kl_coef(c.type, self.kl_coef, kl, c.target_kl, c.horizon, mask.shape[0])
            self.metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": self.kl_coef}
        self.value = ADV_ESTIMATORS.get_fn(cfg.adv_estimator)(rewards, mask, self.group_ids, cfg)
        return self.value
