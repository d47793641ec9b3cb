"""Phase 2 of the update: one mini-batch, one optimizer step (gradient accumulated over micro-batches with the
mini-batch's denominators, verl's global batch info)."""

from __future__ import annotations

import torch

from detrl import guards
from detrl.actor.old_pass import Recompute
from detrl.algos import POLICY_LOSSES, agg_loss, kl_penalty
from detrl.algos.policy_loss import micro_batch_seed
from detrl.loss_scale import LossScaler

CLIP_KEYS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
STEP_KEYS = ("pg_loss", "kl_loss", *CLIP_KEYS, "grad_norm")


def mini_batch_step(
    model, opt, adv: torch.Tensor, old: Recompute, start: int, stop: int, scaler: LossScaler
) -> dict[str, float]:
    """Rows [start, stop): the micro-batches' backwards (this rank's, in rounds under torchrun), the reduced and
    clipped gradient, the optimizer step -> the mini-batch's loss terms, clip fractions and grad norm."""
    s, dp = old.s.spec, old.s.dp
    tokens = old.train_mask[start:stop].sum()
    # global denominators (every rank holds the whole batch); dp_size as verl's agg_loss
    agg = dict(
        mode=s.loss_agg_mode,
        batch_num_tokens=tokens,
        global_batch_size=stop - start,
        loss_scale_factor=s.loss_scale_factor,
        dp_size=dp.loss_scale,
    )
    records = []  # per micro-batch (key, metrics), summed in global micro-batch order below
    opt.zero_grad(set_to_none=True)
    with dp.reducing(model):  # FSDP2: each block's backward sends its gradient shards to their owners
        for item in dp.rounds(start, stop, s.micro_batch_size):
            rec = _round(model, adv, old, item, agg, tokens, scaler)
            if rec is not None:
                records.append((item[0], rec))
    scaler.unscale(opt)  # float16: the true gradients before clipping
    grad_norm = dp.reduce(model, s.grad_clip)  # this rank's gradient shards, clipped
    old.after_mini_batch()
    sums = dict.fromkeys(STEP_KEYS[:-1], 0.0)
    for rec in dp.gather_records(records):
        for k, v in rec.items():
            sums[k] += v
    # the one optimizer step of the mini-batch, skipped on an inf / NaN gradient: float16's scaler lowers its
    # scale; otherwise the step is counted and the run stops after too many in a row
    if scaler.enabled:
        scaler.step(opt)
    else:
        guards.finite_step(opt, grad_norm, s.max_nonfinite_grad_steps)
    return {**sums, "grad_norm": float(grad_norm)}


def _round(
    model, adv, old: Recompute, item, agg: dict, tokens, scaler: LossScaler
) -> dict[str, float] | None:
    """One round's micro-batch on this rank (item None: none) -> its metrics (None: nothing trained). W > 1:
    every rank runs the same passes (their gathers and reduces are collective): where some rank trains, a rank
    that does not runs a backward of zeros and sends nothing; where none does, none runs a backward (`current`
    still scores its rows without gradients)."""
    dp = old.s.dp
    if dp.world == 1:
        return _backward(model, adv, old, item[1], agg, tokens, scaler)
    sl = None if item is None else item[1]
    trains = sl is not None and bool(old.train_mask[sl].any())
    senders, scoring = dp.open_round(trains, sl is not None and not old.policy_pass)
    if trains:
        return _backward(model, adv, old, sl, agg, tokens, scaler)
    if senders or scoring:
        old.idle(model, sl, grad=senders > 0)
    return None


def _backward(
    model, adv, old: Recompute, sl: slice, agg: dict, tokens, scaler: LossScaler
) -> dict[str, float] | None:
    """One micro-batch's loss, backward -> its metrics (None where no token trains: no backward)."""
    s, scale = old.s.spec, old.s.dp.loss_scale
    mask = old.train_mask[sl]
    scored = old.score(model, sl, mask)
    if scored is None:
        return None
    logp, ent = scored
    seed = micro_batch_seed(s.seed, old.s.version, sl.start)  # a loss's own draws (clip_cov)
    pg, m = POLICY_LOSSES.get_fn(s.policy_loss)(logp, old.old[sl], adv[sl], mask, s.loss_cfg, seed=seed)
    pg = pg * old.corr_w[sl]  # MIS's dropped tokens weigh 0 and still count in the denominators (IcePop)
    loss = agg_loss(pg, mask, **agg)
    rec = {"pg_loss": loss.item() / scale}
    if old.ref_logp is not None and s.use_kl_loss:
        kl = agg_loss(kl_penalty(logp, old.ref_logp[sl], s.kl_loss_type), mask, **agg)
        loss = loss + s.kl_loss_coef * kl
        rec["kl_loss"] = kl.item() / scale
    if s.entropy_coeff:
        loss = loss - s.entropy_coeff * agg_loss(ent, mask, **agg)
    scaler.scale(loss).backward()
    share = (mask.sum() / tokens).item()
    return {**rec, **{k: m[k].item() * share for k in CLIP_KEYS}}
