"""The actor update of one rollout batch, as verl's actor (compute_log_prob, then update_policy), in phases:

spec = ActorSpec.from_config(cfg)                   # once: what the update reads of the config
metrics = update(model, ref, opt, batch, adv, spec, ops, ctx_len, rope, version, dp)
  1. the old-logprob pass (`old_pass`: recompute, or current = the gradient pass's own, detached)
  2. ppo_epochs x mini-batches, one optimizer step each (`step.mini_batch_step`)
  3. the trainer/engine mismatch metrics (`metrics.mismatch_metrics`)
"""

from detrl.actor.spec import ActorSpec
from detrl.actor.update import update

__all__ = ["ActorSpec", "update"]
