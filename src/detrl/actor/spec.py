"""What the actor update reads of the run's config, built once (`ActorSpec.from_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ActorSpec:
    temperature: float  # the sampling temperature the logprobs are taken at
    micro_batch_size: int  # sequences per backward
    mini_batch: int  # sequences per optimizer step
    ppo_epochs: int
    old_logprobs: str  # recompute | current (see detrl.actor.old_pass)
    stale_tokens: str  # partial rollouts' stale tokens: keep | mask | rescore
    routing_replay: bool  # MoE: train on the engine's expert ids
    loss_agg_mode: str
    loss_scale_factor: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coeff: float
    rollout_correction: str
    rollout_corr: dict  # the correction's parameters (level, cap, ...)
    grad_clip: float
    policy_loss: str  # algos.POLICY_LOSSES name
    loss_cfg: object  # the loss's parameters (clip ratios, policy_loss_args): the run's AlgoConfig
    use_kl_loss: bool
    seed: int  # the run's seed: a loss's own draws (clip_cov) per micro-batch
    max_nonfinite_grad_steps: int  # non-finite gradient norms in a row before the run stops

    @classmethod
    def from_config(cls, cfg) -> ActorSpec:
        a = cfg.algo
        return cls(
            temperature=cfg.rollout.temperature,
            micro_batch_size=cfg.micro_batch_size,
            mini_batch=(a.ppo_mini_batch_size or cfg.train_batch_size) * cfg.rollout.n,
            ppo_epochs=a.ppo_epochs,
            old_logprobs=a.old_logprobs,
            stale_tokens=cfg.rollout.partial.stale_tokens,
            routing_replay=a.routing_replay,
            loss_agg_mode=a.loss_agg_mode,
            loss_scale_factor=a.loss_scale_factor or cfg.rollout.max_new_tokens,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type,
            entropy_coeff=a.entropy_coeff,
            rollout_correction=a.rollout_correction,
            rollout_corr=dataclasses.asdict(a.rollout_corr),
            grad_clip=cfg.grad_clip,
            policy_loss=a.policy_loss,
            loss_cfg=a,
            use_kl_loss=a.use_kl_loss,
            seed=cfg.seed,
            max_nonfinite_grad_steps=cfg.optim.max_nonfinite_grad_steps,
        )
