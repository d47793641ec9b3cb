"""KL in the reward (verl's `algorithm.use_kl_in_reward`) and its coefficient controllers.

Follows verl @ 1dda039 (verl-project/verl): `apply_kl_penalty` (verl/trainer/ppo/ray_trainer.py) and `FixedKLController` /
`AdaptiveKLController` (verl/trainer/ppo/core_algos.py, Ziegler et al. arXiv 1909.08593); the code is
detrl's own. The token rewards become score - beta * kl_t with kl_t = kl_penalty(old, ref, `algo.kl_penalty`)
on the response tokens; the controller then moves beta once per step. Beside it, the KL *loss*
(`algo.use_kl_loss`) stays as it is: verl allows both at once.
"""

from __future__ import annotations

import torch

from detrl.algos.core import kl_penalty

KL_CTRL_TYPES = ("fixed", "adaptive")


def next_kl_coef(
    kind: str, value: float, current_kl: float, target_kl: float, horizon: int, n_steps: int
) -> float:
    """The coefficient after one step: fixed keeps it; adaptive multiplies by
    1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon (n_steps: the step's sequences, as verl)."""
    if kind == "fixed":
        return value
    if kind == "adaptive":
        err = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
        return value * (1.0 + err * n_steps / horizon)
    raise ValueError(f"algo.kl_ctrl.type={kind!r} is not valid; choose one of {list(KL_CTRL_TYPES)}")


def kl_in_reward(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    beta: float,
) -> tuple[torch.Tensor, float]:
    """-> (token rewards - beta * kl * mask [N, T], the batch's KL: mean over sequences of each one's token mean)."""
    kld = kl_penalty(old_logp, ref_logp, kind).detach() * mask
    per_seq = kld.sum(-1) / mask.sum(-1).clamp_min(1.0)
    current = per_seq.mean().item() if per_seq.numel() else 0.0
    return rewards - beta * kld, current
