"""GRPO / DAPO math as pure tensor functions: no model, no I/O, explicit arguments.

Shapes: B sequences, T response tokens; `mask` [B, T] is 1.0 on response tokens. `agg_loss` takes the
optimizer step's denominators (`batch_num_tokens`, `global_batch_size`, as verl) so that gradient
accumulation over micro-batches sums to exactly the mini-batch loss.
"""

from __future__ import annotations

import math

import torch

# verl's agg_loss modes (1dda039) and token-sum-norm (verl's seq-mean-token-sum-norm until b178a3c)
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
    "token-sum-norm",
)


def compute_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate with dual clip; returns (loss [B, T], masked-mean metrics).

    advantages [B, T] (broadcast per token). For A < 0 the loss is capped at -A * c.
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(l1, l2)
    l3 = -advantages * clip_c
    dual = torch.minimum(l3, clipped)
    loss = torch.where(advantages < 0, dual, clipped)
    n = mask.sum().clamp_min(1.0)
    metrics = {
        "pg_clipfrac": ((l2 > l1).float() * mask).sum() / n,
        "pg_clipfrac_lower": (((clipped > l3) & (advantages < 0)).float() * mask).sum() / n,
        "ppo_kl": (-log_ratio * mask).sum() / n,
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] into a scalar, as verl's `agg_loss` (verl/trainer/ppo/core_algos.py,
    verl-project/verl @ 1dda039, 2026-08-22) does.

    token-mean: Σ loss·mask / batch_num_tokens; token-sum: Σ loss·mask; seq-mean-token-mean: Σ over sequences
    of per-sequence means (Σ loss·mask / (tokens + 1e-8)) / global_batch_size; seq-mean-token-sum: Σ of
    per-sequence sums / global_batch_size; seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (a
    constant, default T; Dr. GRPO's mean over sequences of token sums / the horizon; verl since PR 5417).
    token-sum-norm: Σ loss·mask / loss_scale_factor, no division by the number of sequences: what verl
    called seq-mean-token-sum-norm from 6e6ae96c6 to b178a3c (detrl's before, kept under its own name).
    All modes multiply by dp_size (the data-parallel ranks whose gradients are averaged: 1 on one process;
    under torchrun with determinism=off, detrl.distributed).
    The denominators default to this batch's (valid tokens, sequences with a response token); under
    gradient accumulation pass the optimizer step's (mini-batch) ones so the micro-batches sum to the
    mini-batch's loss. Sequences with no response token add nothing. One deviation: a batch with no
    token at all gives 0 where verl divides by 0.
    """
    seq_tokens = mask.sum(-1)  # [B]
    if mode == "token-mean":
        n_tok = (
            mask.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=loss.dtype)
        )
        return (loss * mask).sum() / _nonzero(n_tok) * dp_size
    factor = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss * mask).sum(-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (seq_tokens + 1e-8)
        seq_mask = (seq_tokens > 0).to(loss.dtype)
        n_seq = (
            seq_mask.sum()
            if global_batch_size is None
            else torch.as_tensor(global_batch_size, dtype=loss.dtype)
        )
        out = (seq_losses * seq_mask).sum() / _nonzero(n_seq) * dp_size
        return out / factor if mode == "seq-mean-token-sum-norm" else out
    if mode == "token-sum-norm":
        return (loss * mask).sum(-1).sum() / factor * dp_size  # dp_size: averaged gradients sum the ranks'
    if mode == "token-sum":
        return (loss * mask).sum() * dp_size
    raise ValueError(f"loss_agg_mode={mode!r} is not valid; choose one of {list(LOSS_AGG_MODES)}")


def _nonzero(n: torch.Tensor) -> torch.Tensor:
    return torch.where(n == 0, torch.ones_like(n), n)


STALE_TOKENS = ("keep", "mask", "rescore")  # rollout.partial.stale_tokens, the modes of `old_logprobs`
LR_SCHEDULERS = ("constant", "cosine")  # optim.lr_scheduler_type, the kinds of `lr_ratio`


def old_logprobs(
    mode: str, trainer_old: torch.Tensor, rollout: torch.Tensor, fresh: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old (proximal) policy's logprobs and the loss mask, by how stale partial-rollout tokens are treated.

    trainer_old: the trainer's logprobs before this step's first update (verl's old_log_prob); rollout: the
    behaviour policy's (the engine's, possibly from older weights); fresh: 1.0 where the current weights
    sampled the token. Fresh tokens always use trainer_old. Stale tokens: keep = the behaviour logprobs (the
    ratio corrects for the lag, clipped); rescore = trainer_old (re-scored by the current weights: ratio 1 at
    the first update, no lag correction); mask = left out of the loss. -> (old [B, T], mask [B, T]).
    """
    if mode == "keep":
        return torch.where(fresh > 0, trainer_old, rollout), mask
    if mode == "rescore":
        return trainer_old, mask
    if mode == "mask":
        return trainer_old, mask * fresh
    raise ValueError(f"stale_tokens={mode!r} is not valid; choose one of {list(STALE_TOKENS)}")


def lr_ratio(
    step: int,
    total_steps: int,
    warmup_steps: int,
    kind: str = "constant",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """The lr multiplier at scheduler step `step` (0-based), as verl's get_constant_schedule_with_warmup /
    get_cosine_schedule_with_warmup: linear warmup from 0 over `warmup_steps`, then constant, or a cosine
    from 1 down to `min_lr_ratio` over the remaining steps."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
        return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)
    raise ValueError(f"lr_scheduler_type={kind!r} is not valid; choose one of {list(LR_SCHEDULERS)}")


def warmup_steps(lr_warmup_steps: int, ratio: float, total_steps: int) -> int:
    """verl's rule: a negative lr_warmup_steps means int(lr_warmup_steps_ratio * total steps)."""
    return int(ratio * total_steps) if lr_warmup_steps < 0 else lr_warmup_steps


KL_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# verl's straight-through names: the base estimator's value with k2's gradient (k2+ / mse+ are k2 itself)
KL_TYPES = KL_BASE + tuple(f"{k}+" for k in KL_BASE)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and a reference, from the sampled tokens' logprobs.

    A name ending in "+" (verl `kl_penalty` @ 1dda039, verl/trainer/ppo/core_algos.py) is straight-through:
    the value of the base estimator, the gradient of k2 = (log p - log ref)^2 / 2, whose expected gradient is
    the KL's (k1's and k3's are not; http://joschu.net/blog/kl-approx.html)."""
    if kind not in KL_TYPES:
        raise ValueError(f"kl_loss_type={kind!r} is not valid; choose one of {list(KL_TYPES)}")
    base = kind.rstrip("+")
    value = _kl_forward(logp, ref_logp, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    delta = (ref_logp - logp).clamp(-20.0, 20.0)  # low_var_kl / k3
    # exp(d) - d - 1 written as expm1(d) - d: in float32 the plain form rounds below 0 for tiny d
    return (torch.expm1(delta) - delta).clamp(-10.0, 10.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def entropy_from_logp(logp_full: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution from its log-probs [.., V] -> [..]."""
    return -(logp_full.exp() * logp_full).sum(-1)
