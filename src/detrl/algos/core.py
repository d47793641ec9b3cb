"""GRPO / DAPO math as pure tensor functions: no model, no I/O, explicit arguments.

Shapes: B sequences, T response tokens; `mask` [B, T] is 1.0 on response tokens. Functions that
aggregate take global denominators (`global_tokens`, `global_seqs`) so that gradient accumulation over
micro-batches sums to exactly the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ADV_ESTIMATORS: dict[str, Callable] = {}


def register_adv_estimator(name: str):
    def deco(fn):
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


@register_adv_estimator("grpo")
def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                    epsilon: float = 1e-6) -> torch.Tensor:
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


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float, clip_c: float,
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


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float | None = None,
             global_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] into a scalar; the one switch between GRPO, DAPO and Dr. GRPO.

    token-mean: sum / all tokens; seq-mean-token-mean: mean over sequences of per-sequence means;
    seq-mean-token-sum: mean over sequences of sums; seq-mean-token-sum-norm: sum / (seqs * max_len).
    Denominators default to this batch's; pass the step's global ones under gradient accumulation.
    Sequences with no response token count in no denominator.
    """
    seq_tokens = mask.sum(-1)  # [B]
    valid = (seq_tokens > 0).float()
    n_seqs = valid.sum() if global_seqs is None else torch.as_tensor(global_seqs, dtype=loss.dtype)
    n_seqs = n_seqs.clamp_min(1.0)
    if mode == "token-mean":
        n_tok = mask.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=loss.dtype)
        return (loss * mask).sum() / n_tok.clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / seq_tokens.clamp_min(1.0)
        return (per_seq * valid).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return ((loss * mask).sum(-1) * valid).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        length = loss.shape[-1] if max_len is None else max_len
        return (loss * mask).sum() / (n_seqs * length)
    raise ValueError(
        f"loss_agg_mode={mode!r} is not valid; choose one of "
        "['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm']"
    )


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and a reference, from the sampled tokens' logprobs."""
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        delta = (ref_logp - logp).clamp(-20.0, 20.0)
        # exp(d) - d - 1 written as expm1(d) - d: in float32 the plain form rounds below 0 for tiny d
        return (torch.expm1(delta) - delta).clamp(-10.0, 10.0)
    raise ValueError(f"kl_loss_type={kind!r} is not valid; choose one of ['kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3']")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def entropy_from_logp(logp_full: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution from its log-probs [.., V] -> [..]."""
    return -(logp_full.exp() * logp_full).sum(-1)
