from detrl.algos.advantages import ADV_ESTIMATORS, grpo_advantages, token_rewards
from detrl.algos.core import (
    agg_loss,
    compute_policy_loss,
    kl_penalty,
    lr_ratio,
    old_logprobs,
    warmup_steps,
)
from detrl.algos.dapo import filter_groups, overlong_penalty
from detrl.algos.policy_loss import POLICY_LOSSES

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "agg_loss",
    "compute_policy_loss",
    "filter_groups",
    "grpo_advantages",
    "kl_penalty",
    "lr_ratio",
    "old_logprobs",
    "overlong_penalty",
    "token_rewards",
    "warmup_steps",
]
