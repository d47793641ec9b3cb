"""Trainer/rollout mismatch corrections as pure tensor functions: no model, no I/O, explicit arguments.

When the rollout engine's logprobs of the sampled tokens (`rollout_logp`, the behaviour policy
pi_rollout) differ from the trainer's logprobs of the same tokens under the same weights (`old_logp`,
pi_old: detrl's `old` in `actor.update`), the policy gradient is off-policy. With `determinism=on`
the two are bitwise equal and every correction here is an exact no-op (weights == 1, mask unchanged,
bit for bit). With `off` they differ by ~1e-5 on the default model; on real engines (bf16 vLLM/SGLang
vs an fp32 trainer) by much more. Shapes: B sequences, T response tokens; `mask` [B, T] is 1.0 on the
tokens that enter the loss. The per-token importance ratio is

    r_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t)

computed from a log-ratio clamped to [-20, 20] (verl's SAFETY_BOUND) and always **detached**: the
weights change the measure the gradient is estimated under, not the objective (verl
docs/algo/rollout_corr_math.md section 3.2.2). Modes:

- ``none``: weights 1, mask unchanged (the metrics are still computed: they show what TIS/MIS would do).
- ``tis`` -- truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; verl
  `compute_rollout_correction_weights`, formerly `tis_imp_ratio_cap`, in
  verl/trainer/ppo/rollout_corr_helper.py @ b178a3c): w = min(r, C), detached, multiplies the per-token
  policy loss; padding/non-loss tokens get weight 1 here (verl zeroes them; the loss mask zeroes them
  anyway, and 1 keeps `loss * w` a bitwise no-op). Token level (default; biased, low variance, the TIS
  paper's choice) or sequence level (verl `rollout_is="sequence"`: one weight per sequence,
  w_i = min(exp(sum_t log r_t), C), broadcast to its tokens; unbiased before truncation, high variance).
- ``mis`` -- masked importance sampling (IcePop, Ling Team, "Every Step Evolves: Scaling RL for
  Trillion-Scale Thinking Model", arXiv 2510.18855, used for Ring-1T): tokens whose ratio falls outside
  [alpha, beta] are dropped from the gradient, M(k; alpha, beta) = k if k in [alpha, beta] else 0,
  with k = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old) -- a constant (detached) coefficient on
  the clipped PPO surrogate. IcePop defaults alpha = 0.5, beta = 5. `mis_weight="ratio"` (default) is
  IcePop's M (the kept tokens carry k); `mis_weight="one"` is verl's rejection sampling alone
  (`rollout_is=None, rollout_rs="token_k1"`): kept tokens weigh 1. Sequence level = verl's Seq-MIS
  (`rollout_rs="seq_sum_k1"`, `decoupled_seq_is_rs`): a whole sequence is dropped when its sequence
  ratio exp(sum_t log r_t) is outside [lower, upper]. Bounds here are on r = pi_old / pi_rollout, as
  IcePop writes them. (verl's k1 filters, at b178a3c, compare -log r with [log lower, log upper], i.e.
  they bound 1/r; for the symmetric-in-log bounds verl's docs use, e.g. 0.5_2.0, the two agree.)

MIS's dropped tokens get weight 0 and stay in the returned mask, so the loss denominators still count
them, as IcePop's objective does (1/|y_i| over all of a sequence's tokens, masked ones contributing 0).

Rejection sampling (verl `rollout_rs`, `compute_rollout_rejection_mask` in
verl/trainer/ppo/rollout_corr_helper.py @ 1dda039, verl-project/verl): `rollout_rs` is a comma-separated chain
of filters, every one of which a token must pass: `token_k1|k2|k3`, `seq_sum_k1|k2|k3`, `seq_mean_k1|k2|k3`,
`seq_max_k2|k3`, on the divergences of the per-token log-ratio l = old - rollout, clamped to [-20, 20] *before*
any sum: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - 1 - l. `rollout_rs_threshold` gives one threshold for all or one
per filter (comma-separated): k1 filters take "lower_upper" on the ratio (a single value u means 1/u_u) and keep
log(lower) <= k1 <= log(upper); k2 / k3 take an upper bound. Rejected tokens leave the returned mask, so the
caller's loss and its denominators drop them, as verl rewrites `response_mask`. `rollout_is_batch_normalize`
(verl's) divides the TIS / MIS weights by their mean over the batch's mask tokens (per sequence at sequence
level), so they average 1. Under `determinism=on` every ratio is 1: no token is rejected (thresholds must keep
l = 0), weights stay 1, the normalisation divides by 1.
"""

from __future__ import annotations

import math

import torch

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence")
MIS_WEIGHTS = ("ratio", "one")
SAFETY_BOUND = 20.0  # verl's clamp on log-ratios before exp
METRIC_KEYS = (
    "weight_mean",
    "weight_max",
    "truncated_frac",
    "masked_frac",
    "rejected_frac",
    "rejected_seq_frac",
    "ratio_min",
    "ratio_max",
)
RS_OPTIONS = tuple(
    [f"{agg}_k{k}" for agg in ("token", "seq_sum", "seq_mean") for k in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)


def validate(
    mode: str = "none",
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.5,
    upper: float = 5.0,
    mis_weight: str = "ratio",
    rollout_rs: str = "",
    rollout_rs_threshold: str = "2.0",
    rollout_is_batch_normalize: bool = False,
    prefix: str = "rollout_correction",
) -> None:
    """One-line ValueError for a bad setting. The bounds are chosen so that ratio 1 (no mismatch)
    is always kept at weight 1: cap >= 1 and lower <= 1 <= upper, which makes every mode an exact
    no-op under `determinism=on`."""

    def bad(key, value, why):
        raise ValueError(f"{prefix}.{key}={value!r} is not valid; {why}")

    if mode not in MODES:
        bad("mode", mode, f"choose one of {list(MODES)}")
    if level not in LEVELS:
        bad("level", level, f"choose one of {list(LEVELS)}")
    if mis_weight not in MIS_WEIGHTS:
        bad("mis_weight", mis_weight, f"choose one of {list(MIS_WEIGHTS)}")
    if not cap >= 1.0:
        bad("cap", cap, "the TIS cap must be >= 1 (a ratio of 1 must keep weight 1)")
    if not 0.0 < lower <= 1.0:
        bad("lower", lower, "the MIS lower bound must be in (0, 1]")
    if not upper >= 1.0:
        bad("upper", upper, "the MIS upper bound must be >= 1")
    try:
        rs_thresholds(rollout_rs, rollout_rs_threshold)
    except ValueError as e:
        raise ValueError(f"{prefix}.{e}") from None


def rs_thresholds(rollout_rs: str, spec: str) -> dict[str, tuple[float | None, float]]:
    """The chain's filters -> (lower, upper) each (lower only for k1), from verl's threshold string."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    for o in options:
        if o not in RS_OPTIONS:
            raise ValueError(
                f"rollout_rs={o!r} is not valid; choose a comma-separated chain of {list(RS_OPTIONS)}"
            )
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if options and len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r} is not valid; give 1 or {len(options)} thresholds")
    out = {}
    for o, sp in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            lo, _, hi = sp.partition("_")
            upper = float(hi or lo)
            lower = (float(lo) if hi else 1.0 / upper) if o.endswith("k1") else None
        except ValueError:
            raise ValueError(
                f"rollout_rs_threshold={spec!r} is not valid; numbers, k1 as lower_upper"
            ) from None
        if upper <= 0 or (lower is not None and not 0 < lower <= 1 <= upper) or (lower is None and "_" in sp):
            raise ValueError(
                f"rollout_rs_threshold={spec!r} is not valid for {o}: k1 needs 0 < lower <= 1 <= upper "
                "(ratio 1 must pass), k2 / k3 one upper bound > 0"
            )
        out[o] = (lower, upper)
    return out


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's rejection chain -> (keep [B, T] 0/1 float, rejected-sequence indicator [B]). See the module doc."""
    keep = torch.ones_like(mask)
    on = mask > 0
    lr = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.expm1(lr) - lr}
    n = mask.sum(-1).clamp_min(1.0)
    for option, (lower, upper) in rs_thresholds(rollout_rs, threshold).items():
        agg, k = option.rsplit("_", 1)
        x = stats[k]
        if agg == "seq_sum":
            x = (x * mask).sum(-1, keepdim=True)
        elif agg == "seq_mean":
            x = (x * mask).sum(-1, keepdim=True) / n.unsqueeze(-1)
        elif agg == "seq_max":
            x = torch.where(on, x, torch.full_like(x, -torch.inf)).amax(-1, keepdim=True).clamp_min(0.0)
        ok = (x >= math.log(lower)) & (x <= math.log(upper)) if lower is not None else x <= upper
        keep = keep * ok.expand_as(mask).to(mask.dtype)
    return keep, ((keep == 0) & on).any(-1)


def importance_ratio(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
) -> torch.Tensor:
    """Detached r = pi_old / pi_rollout [B, T]: per token, or per sequence (exp of the masked sum of
    log-ratios, broadcast over the sequence). Log-ratios are clamped to [-20, 20] before exp."""
    log_ratio = (old_logp - rollout_logp).detach()
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "none",
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.5,
    upper: float = 5.0,
    mis_weight: str = "ratio",
    rollout_rs: str = "",
    rollout_rs_threshold: str = "2.0",
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """-> (weights [B, T], mask [B, T], metrics). Use as `loss = agg_loss(pg * weights, mask, ...)`.

    weights: detached; 1.0 on tokens outside `mask` and wherever no correction applies, 0.0 on tokens
    MIS drops. mask: the input mask less the tokens `rollout_rs` rejects (the same tensor without it): the
    loss mask, whose denominators then leave them out; MIS's drops stay in it at weight 0.
    metrics (0-d tensors over the input mask's tokens; merge micro-batches with `merge_metrics`):
    `rollout_corr/weight_mean`, `weight_max` (the weights applied; dropped tokens count as 0),
    `truncated_frac` (TIS: ratio > cap), `masked_frac` (MIS: dropped), `rejected_frac` (rollout_rs: tokens
    rejected), `rejected_seq_frac` (sequences with a rejected token), `ratio_min`, `ratio_max` (the raw
    ratio, before truncation; the sequence ratio at sequence level). Same keys for every mode.

    >>> old, roll, m = torch.tensor([[0.0, 0.0]]), torch.tensor([[-1.0, 0.5]]), torch.ones(1, 2)
    >>> rollout_correction(old, roll, m, "tis", cap=2.0)[0]
    tensor([[2.0000, 0.6065]])
    >>> rollout_correction(old, roll, m, "mis", lower=0.5, upper=2.0)[0]
    tensor([[0.0000, 0.6065]])
    >>> rollout_correction(old, roll, m, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")[1]
    tensor([[0., 1.]])
    """
    validate(mode, level, cap, lower, upper, mis_weight, rollout_rs, rollout_rs_threshold)
    if not old_logp.shape == rollout_logp.shape == mask.shape:
        raise ValueError(
            f"shapes differ: old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    ratio = importance_ratio(old_logp, rollout_logp, mask, level)
    on = mask > 0
    one = torch.ones_like(ratio)
    zero = torch.zeros_like(ratio)
    truncated = zero
    mis_mask = mask
    if mode == "none":
        weights = one
    elif mode == "tis":
        truncated = (ratio > cap).to(ratio.dtype)
        weights = torch.where(on, ratio.clamp(max=cap), one)
    else:  # mis
        keep = (ratio >= lower) & (ratio <= upper)
        kept = ratio if mis_weight == "ratio" else one
        weights = torch.where(on, torch.where(keep, kept, zero), one)
        mis_mask = mask * keep.to(mask.dtype)
    out_mask, rejected_seq = mask, torch.zeros(mask.shape[0], dtype=torch.bool)
    if rollout_rs:
        keep_rs, rejected_seq = rejection_mask(
            old_logp - rollout_logp, mask, rollout_rs, rollout_rs_threshold
        )
        out_mask = mask * keep_rs
    if rollout_is_batch_normalize and mode != "none":
        weights = weights / _weight_mean(weights, out_mask, level)
    metrics = _metrics(ratio, weights, truncated, mask, mis_mask)
    metrics["rollout_corr/rejected_frac"] = (mask - out_mask).sum() / mask.sum().clamp_min(1.0)
    seqs = (mask.sum(-1) > 0).sum().clamp_min(1)
    metrics["rollout_corr/rejected_seq_frac"] = rejected_seq.sum().to(mask.dtype) / seqs
    return weights.detach(), out_mask, metrics


def _weight_mean(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """verl's batch-normalisation factor: the mean weight over mask tokens, or over sequences at sequence level."""
    if level == "sequence":
        has = mask.sum(-1) > 0
        per_seq = (weights * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        mean = per_seq[has].mean() if has.any() else torch.ones((), dtype=weights.dtype)
    else:
        mean = (weights * mask).sum() / mask.sum().clamp_min(1.0)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))


def _metrics(ratio, weights, truncated, mask, out_mask) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        on = mask > 0
        n = mask.sum().clamp_min(1.0)
        if on.any():
            w_max, r_min, r_max = weights[on].max(), ratio[on].min(), ratio[on].max()
        else:
            w_max = r_min = r_max = torch.ones((), dtype=ratio.dtype)
        m = {
            "weight_mean": (weights * mask).sum() / n,
            "weight_max": w_max,
            "truncated_frac": (truncated * mask).sum() / n,
            "masked_frac": (mask - out_mask).sum() / n,
            "ratio_min": r_min,
            "ratio_max": r_max,
        }
    return {f"rollout_corr/{k}": v.detach() for k, v in m.items()}


def merge_metrics(parts: list[tuple[dict[str, torch.Tensor], float]]) -> dict[str, float]:
    """Merge micro-batches' metrics: (metrics, number of mask tokens) each -> one step's floats.
    `*_max` keys take the max, `*_min` the min (over parts with tokens), the rest the token-weighted mean."""
    parts = [(m, float(n)) for m, n in parts if float(n) > 0] or [(m, 1.0) for m, _ in parts[:1]]
    if not parts:
        return {
            f"rollout_corr/{k}": (
                1.0 if k in ("weight_mean", "weight_max", "ratio_min", "ratio_max") else 0.0
            )
            for k in METRIC_KEYS
        }
    total = sum(n for _, n in parts)
    out = {}
    for key in parts[0][0]:
        vals = [float(m[key]) for m, _ in parts]
        if key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        else:
            out[key] = sum(v * n for v, (_, n) in zip(vals, parts, strict=True)) / total
    return out
