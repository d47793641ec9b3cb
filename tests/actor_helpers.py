"""The actor update called as tests call it: from a TrainConfig, one process's reduce unless one is given."""

from __future__ import annotations

from detrl import actor, distributed
from detrl.actor import ActorSpec


def update(model, ref_model, opt, batch, adv, cfg, ops, ctx_len, rope, version: int, dp=None, scaler=None):
    """`detrl.actor.update` with the spec built from `cfg` (train() builds it once) and, unless given, the
    ordered reduce of one process."""
    dp = dp if dp is not None else distributed.DataParallel(model, ordered=True)
    spec = ActorSpec.from_config(cfg)
    return actor.update(model, ref_model, opt, batch, adv, spec, ops, ctx_len, rope, version, dp, scaler)
