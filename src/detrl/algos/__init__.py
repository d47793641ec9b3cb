from detrl.algos.core import (
    ADV_ESTIMATORS,
    agg_loss,
    compute_policy_loss,
    grpo_advantages,
    kl_penalty,
    lr_ratio,
    old_logprobs,
    warmup_steps,
)
from detrl.algos.dapo import filter_groups, overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "agg_loss",
    "compute_policy_loss",
    "filter_groups",
    "grpo_advantages",
    "kl_penalty",
    "lr_ratio",
    "old_logprobs",
    "overlong_penalty",
    "warmup_steps",
]
