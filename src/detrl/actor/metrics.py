"""Phase 3 of the update: the trainer's old logprobs against the engine's, the same weights (fresh tokens)."""

from __future__ import annotations

import torch

from detrl.actor.old_pass import Recompute


def mismatch_metrics(old: Recompute) -> dict[str, float]:
    """mismatch/*: 0 is true on-policy (the same weights in two engines); stale tokens carry the policy lag too."""
    b = old.s.batch
    f = old.s.fresh > 0
    d = (old.old_trainer - b.rollout_logp)[f]
    pd = (old.old_trainer.exp() - b.rollout_logp.exp())[f].abs()
    lag = (old.old_trainer - b.rollout_logp)[(b.mask > 0) & ~f].abs()
    return {
        "mismatch/train_rollout_logprob_abs_diff": _mean(d.abs()),
        "mismatch/train_rollout_logprob_abs_diff_max": _top(d.abs()),
        "mismatch/k3_kl": _mean(torch.expm1(-d) + d),  # k3 of the rollout policy against the trainer's
        "mismatch/max_prob_diff": _top(pd),
        "mismatch/stale_logprob_abs_diff": _mean(lag),  # stale tokens: policy lag + engine mismatch
        **{k: float(v) for k, v in old.corr_metrics.items()},
        # fraction of fresh response (token, layer) slots where the trainer's top-k set is the engine's
        **({} if old.agree is None else {"mismatch/router_agreement": _mean(old.agree[f])}),
    }


def _mean(x: torch.Tensor) -> float:
    return x.mean().item() if x.numel() else 0.0


def _top(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else 0.0
