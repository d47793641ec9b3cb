"""The update of one rollout batch: the old-logprob pass, epochs x mini-batches, the metrics."""

from __future__ import annotations

import torch

from detrl import distributed, guards
from detrl.actor.metrics import mismatch_metrics
from detrl.actor.old_pass import OLD_LOGPROBS, Scoring
from detrl.actor.spec import ActorSpec
from detrl.actor.step import STEP_KEYS, mini_batch_step
from detrl.algos.core import masked_mean
from detrl.collect import StepBatch
from detrl.loss_scale import LossScaler


def update(
    model,
    ref_model,
    opt,
    batch: StepBatch,
    adv,
    spec: ActorSpec,
    ops,
    ctx_len: int,
    rope,
    version: int,
    dp: distributed.DataParallel,
    scaler: LossScaler | None = None,
) -> dict[str, float]:
    """PPO-style update of one rollout batch, as verl's actor (compute_log_prob, then update_policy) -> metrics.

    Three policies: behaviour (the engine's rollout logprobs), old (`old_pass`), current (the grad pass). The
    clip ratio is current / old; `mismatch/*` compares old with behaviour on the tokens the current weights
    sampled. `spec.ppo_epochs` passes over `spec.mini_batch`-sequence mini-batches in batch order, one optimizer
    step each; pg_clipfrac / ppo_kl are token means over each mini-batch, averaged over the step's mini-batches.
    `dp` (`detrl.distributed.DataParallel`) says which micro-batches this rank runs and reduces the gradients.
    MoE with recorded routing: `mismatch/router_agreement` compares the old pass's own top-k ids with the
    engine's; `spec.routing_replay` makes the policy's passes use the engine's ids on the response tokens.
    `adv`: advantages [N] or [N, L-1], or a callable (old, ref logprobs) -> [N, L-1] called once both are known
    (`StepAdvantages`: KL in the reward). `scaler` (`detrl.loss_scale`): float16's dynamic loss scaling.
    """
    scaler = scaler or LossScaler(torch.float32, batch.mask.device)  # disabled: float32 / bfloat16
    fresh = (batch.versions == version).float() * batch.mask  # tokens sampled by the current weights
    old = OLD_LOGPROBS[spec.old_logprobs](Scoring(spec, batch, fresh, ops, ctx_len, rope, dp, version))
    old.before(model, ref_model)
    adv = adv(old.old, old.ref_logp) if callable(adv) else adv  # KL in the reward needs old and ref first
    adv = adv if adv.dim() == 2 else adv[:, None].expand_as(batch.mask)  # [N, L-1]
    n = batch.input_ids.shape[0]
    per_step: dict[str, list[float]] = {k: [] for k in STEP_KEYS}
    for _ in range(spec.ppo_epochs):
        for start in range(0, n, spec.mini_batch):
            for k, v in mini_batch_step(
                model, opt, adv, old, start, min(start + spec.mini_batch, n), scaler
            ).items():
                per_step[k].append(v)
    opt.zero_grad(set_to_none=True)
    old.finish()
    return {
        **{f"actor/{k}": sum(v) / len(v) for k, v in per_step.items()},
        "actor/entropy": masked_mean(old.ent, batch.mask).item(),
        "actor/lr": opt.param_groups[0]["lr"],
        "actor/optimizer_steps": float(len(per_step["grad_norm"])),
        "actor/nonfinite_grad_steps": guards.pop_nonfinite(opt),
        "actor/loss_token_frac": (old.train_mask.sum() / batch.mask.sum().clamp_min(1.0)).item(),
        **mismatch_metrics(old),
        **scaler.metrics(),
    }
