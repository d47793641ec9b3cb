"""Phase 1 of the update: the old (proximal) policy's logprobs, the reference's, entropy and router agreement.

Two strategies (`algo.old_logprobs`), each with the same four hooks the update calls:
- recompute (verl's old_log_prob): one no-grad pass of the policy before any update; the gradient pass scores
  only micro-batches where some token trains;
- current (TRL's, one epoch of one mini-batch: the same weights): no pass of its own; each micro-batch's
  gradient-pass logprobs, detached, are its old ones (ratio 1, one forward less); the correction's diagnostics
  once every old logprob is known.
Stale partial-rollout tokens get theirs from `algos.old_logprobs` in both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from detrl import distributed
from detrl.actor.spec import ActorSpec
from detrl.algos import old_logprobs
from detrl.algos.rollout_correction import rollout_correction
from detrl.algos.routing import layer_agreement
from detrl.collect import StepBatch
from detrl.models.logprobs import sequence_logprobs


@dataclass
class Scoring:
    """What a pass needs besides the weights: the batch and how to score it."""

    spec: ActorSpec
    batch: StepBatch
    fresh: torch.Tensor  # [N, L-1] 1.0 where the current weights sampled the token
    ops: object
    ctx_len: int
    rope: object
    dp: distributed.DataParallel
    version: int = 0  # the policy version being trained (seeds a loss's own draws)

    def logprobs(self, model, sl: slice, mask: torch.Tensor, replay: bool = True, **kw):
        """sequence_logprobs of rows `sl` (the policy's passes: the engine's expert ids under routing replay)."""
        b = self.batch
        experts = b.routed_experts[sl].long() if replay and self.spec.routing_replay else None
        return sequence_logprobs(
            model,
            b.input_ids[sl],
            mask,
            self.ops,
            self.ctx_len,
            self.rope,
            self.spec.temperature,
            experts=experts,
            **kw,
        )


class Recompute:
    """verl's compute_log_prob: the policy's (and reference's) logprobs before the first update."""

    policy_pass = True

    def __init__(self, s: Scoring):
        b, self.s = s.batch, s
        self.old_trainer, self.ent = torch.zeros_like(b.mask), torch.zeros_like(b.mask)
        self.recorded = b.routed_experts  # [N, L-1, layers, k] or None
        self.agree = None if self.recorded is None else torch.zeros_like(b.mask)  # per token, over layers
        self.ref_logp = None
        self.mine = [sl for _, sl in s.dp.micro_batches(0, b.input_ids.shape[0], s.spec.micro_batch_size)]

    def before(self, model, ref_model) -> None:
        """The no-grad pass over this rank's micro-batches; rows gathered; old, loss mask and correction."""
        s, b = self.s, self.s.batch
        with torch.no_grad():
            if ref_model is not None:
                self.ref_logp = torch.zeros_like(b.mask)
            # rounds: under FSDP2 every rank runs as many passes (their gathers are collective), one row where
            # it holds no micro-batch of a round
            for item in s.dp.rounds(0, b.input_ids.shape[0], s.spec.micro_batch_size):
                sl = slice(0, 1) if item is None else item[1]
                if self.policy_pass:  # the router's own ids only when the engine recorded some
                    out = s.logprobs(model, sl, b.mask[sl], entropy=True, routes=self.agree is not None)
                    if item is not None:
                        self._keep(sl, out)
                if ref_model is not None:
                    ref, _ = s.logprobs(ref_model, sl, b.mask[sl], replay=False)
                    if item is not None:
                        self.ref_logp[sl] = ref
        if self.policy_pass:
            self.old_trainer, self.ent, self.agree = s.dp.gather_rows(
                [self.old_trainer, self.ent, self.agree], self.mine
            )
        self.ref_logp = s.dp.gather_rows([self.ref_logp], self.mine)[0]
        self.old, self.train_mask = old_logprobs(
            s.spec.stale_tokens, self.old_trainer, b.rollout_logp, s.fresh, b.mask
        )
        # trainer/rollout mismatch correction (TIS / MIS weights on the policy loss; rollout_rs rejects tokens from
        # the loss mask and its denominators); ones and the same mask under determinism=on
        self.corr_w, self.train_mask, self.corr_metrics = self._correction()

    def score(self, model, sl: slice, mask: torch.Tensor):
        """The gradient pass of rows `sl` -> (logp, entropy), or None where no token trains."""
        if not mask.any():
            return None
        return self.s.logprobs(model, sl, mask, entropy=bool(self.s.spec.entropy_coeff))

    def idle(self, model, sl: slice | None, grad: bool) -> None:
        """FSDP2: a pass that trains nothing, so that this rank runs a round's gathers (and, grad, the backward's
        reduces, sending zeros or nothing) with the others: one row of the batch, every position scored."""
        one = slice(0, 1)
        with contextlib.nullcontext() if grad else torch.no_grad():
            logp, _ = self.s.logprobs(model, one, torch.ones_like(self.s.batch.mask[one]))
        if grad:
            (logp.sum() * 0).backward()

    def after_mini_batch(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def _keep(self, sl: slice, out) -> None:
        self.old_trainer[sl], self.ent[sl] = out[0].detach(), out[1].detach()
        if self.agree is not None:
            self.agree[sl] = layer_agreement(out[2], self.recorded[sl])

    def _correction(self):
        s, b = self.s.spec, self.s.batch
        return rollout_correction(
            self.old, b.rollout_logp, self.train_mask, s.rollout_correction, **s.rollout_corr
        )


class Current(Recompute):
    """TRL's: the gradient pass's own logprobs, detached, are the old ones (the weights have not moved yet)."""

    policy_pass = False

    def score(self, model, sl: slice, mask: torch.Tensor):
        """Every response token's logprobs (metrics); without gradients where no token trains."""
        with contextlib.nullcontext() if mask.any() else torch.no_grad():
            out = self._scored(model, sl)
        return out[:2] if mask.any() else None

    def idle(self, model, sl: slice | None, grad: bool) -> None:
        """FSDP2, a round this rank trains nothing in: its micro-batch (if any) still scored, by the same pass
        (with a backward of zeros where other ranks train: the same collectives as theirs); else one row's."""
        b = self.s.batch
        if sl is None or not b.mask[sl].any():  # (nothing to score: its logprobs are zeros either way)
            return super().idle(model, sl, grad)
        with contextlib.nullcontext() if grad else torch.no_grad():
            logp, _ = self._scored(model, sl)
        if grad:
            (logp.sum() * 0).backward()

    def _scored(self, model, sl: slice):
        b = self.s.batch
        out = self.s.logprobs(model, sl, b.mask[sl], entropy=True, routes=self.agree is not None)
        self._keep(sl, out)
        self.old[sl] = old_logprobs(
            self.s.spec.stale_tokens, self.old_trainer[sl], b.rollout_logp[sl], self.s.fresh[sl], b.mask[sl]
        )[0]
        return out

    def after_mini_batch(self) -> None:
        self.old_trainer, self.ent, self.agree = self.s.dp.gather_rows(
            [self.old_trainer, self.ent, self.agree], self.mine
        )

    def finish(self) -> None:
        """The correction's diagnostics, now that every old logprob is known (its weights were ones: none)."""
        b = self.s.batch
        self.old = old_logprobs(
            self.s.spec.stale_tokens, self.old_trainer, b.rollout_logp, self.s.fresh, b.mask
        )[0]
        self.corr_metrics = self._correction()[2]


OLD_LOGPROBS = {"recompute": Recompute, "current": Current}
