"""The algo group (`conf/algo/*.yaml`): the preset, its registry-chosen variants and their knobs.

Each name is checked against the registry that implements it (`detrl.algos.*`, `detrl.actor`), so the list
of choices in an error message is the list the code runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detrl.config.base import ConfigError, check, choice

ALGO_NAMES = ("grpo", "dapo", "gspo", "rloo")  # the presets in conf/algo/


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (verl's algorithm.filter_groups): drop groups whose `metric` is all equal."""

    enabled: bool = False
    # acc / score: the task reward before shaping (here both are exact-match correctness);
    # seq_reward / seq_final_reward: the reward the advantages use (incl. overlong shaping; no in-reward KL here)
    metric: str = "acc"
    max_num_gen_batches: int = 10  # 0 = no limit


@dataclass
class OverlongConfig:
    enabled: bool = False
    buffer_len: int = 2
    penalty_factor: float = 1.0


@dataclass
class RolloutCorrParams:
    """Parameters of algo.rollout_correction (detrl.algos.rollout_correction has the formulas and sources)."""

    level: str = "token"  # token | sequence
    cap: float = 2.0  # tis: weights min(ratio, cap); >= 1
    lower: float = 0.5  # mis: tokens with ratio outside [lower, upper] leave the loss; lower <= 1
    upper: float = 5.0  # upper >= 1
    mis_weight: str = "ratio"  # ratio (IcePop: kept tokens weighted by their ratio) | one (rejection only)
    # verl's rejection sampling: a comma-separated chain of token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    # seq_max_k2|k3 ("" = none); rejected tokens leave the loss and its denominators (any rollout_correction)
    rollout_rs: str = ""
    rollout_rs_threshold: str = (
        "2.0"  # one for all or one per filter; k1: lower_upper on the ratio (u = 1/u_u)
    )
    rollout_is_batch_normalize: bool = False  # tis / mis weights divided by their batch mean


@dataclass
class PolicyLossArgs:
    """Loss-specific knobs of algo.policy_loss, verl's names and defaults (actor.yaml @ b178a3c)."""

    tau_pos: float = 1.0  # sapo: gate temperature where A > 0
    tau_neg: float = 1.05  # sapo: where A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance window
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens with the |log r| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: its coefficient


@dataclass
class KLCtrlConfig:
    """The in-reward KL coefficient's controller (verl's algorithm.kl_ctrl)."""

    type: str = "fixed"  # fixed | adaptive (Ziegler et al.: beta follows target_kl over horizon sequences)
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgoConfig:
    name: str = "grpo"  # the preset: grpo | dapo | gspo | rloo
    # verl's algorithm.adv_estimator: grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | opo | gpg |
    # grpo_passk (detrl.algos.advantages.ADV_ESTIMATORS)
    adv_estimator: str = "grpo"
    # TRL's scale_rewards for grpo: group (divide by the group's std) | batch (by the batch's) | none;
    # norm_adv_by_std=false is none
    scale_rewards: str = "group"
    gamma: float = 1.0  # reinforce_plus_plus: discount of the returns-to-go
    # verl's actor.policy_loss.loss_mode: vanilla | gspo | cispo | sapo | gpg | geo_mean | clip_cov | kl_cov
    # (detrl.algos.policy_loss.POLICY_LOSSES)
    policy_loss: str = "vanilla"
    policy_loss_args: PolicyLossArgs = field(default_factory=PolicyLossArgs)
    norm_adv_by_std: bool = True  # false = Dr. GRPO
    adv_epsilon: float = 1e-6
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip for negative advantages (> 1)
    loss_agg_mode: str = "seq-mean-token-mean"
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # kl|k1, abs, mse|k2, low_var_kl|k3; a "+" suffix: k2's gradient
    # KL in the reward (verl's algorithm.use_kl_in_reward): token rewards - beta * kl_penalty(old, ref)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # the estimator in the reward (the names of kl_loss_type)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    entropy_coeff: float = 0.0
    # seq-mean-token-sum-norm and token-sum-norm divide by this constant (verl's loss_scale_factor);
    # null = rollout.max_new_tokens (the response length)
    loss_scale_factor: int | None = None
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences), as verl; 0 or >= train_batch_size = the whole batch
    ppo_epochs: int = 1  # passes over the rollout batch
    # the clip ratio's old logprobs: recompute = a no-grad pass before any update (verl's old_log_prob) | current =
    # the gradient pass's own, detached (TRL and OpenRLHF at one epoch of one mini-batch, where the two are the
    # same weights: one forward less a step); current needs ppo_epochs=1, one mini-batch, rollout_correction=none
    old_logprobs: str = "recompute"
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # prompts drawn per generation round (verl's data.gen_batch_size; the DAPO recipe uses 3 x train_batch_size);
    # 0 = train_batch_size. Groups beyond train_batch_size that pass the filter are left out, as verl
    gen_batch_size: int = 0
    # verl's trainer.balance_batch: reorder each mini-batch so its micro-batches carry near-equal token counts
    balance_batch: bool = False
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # trainer/rollout mismatch correction of the policy loss: none | tis (truncated IS) | mis (masked IS, IcePop);
    # the ratio is old (trainer) / behaviour (rollout): exactly 1 under determinism=on, so both are no-ops there
    rollout_correction: str = "none"
    rollout_corr: RolloutCorrParams = field(default_factory=RolloutCorrParams)
    # MoE routing replay (R3): the trainer's forward uses the expert ids the rollout engine routed each response
    # token's pass to (its own router still weights them); needs model=qwen3_moe and an engine that records
    routing_replay: bool = False

    def validate(self) -> None:
        """Every algo rule that reads no other group (the batch sizes and the rollout: detrl.config.cross)."""
        _validate_correction(self)
        choice("algo.name", self.name, ALGO_NAMES)
        _validate_algo_variants(self)
        _validate_bounds(self)
        _validate_old_logprobs(self)


def _validate_algo_variants(a: AlgoConfig) -> None:
    """The registry-chosen names (each registry is the one list of choices) and their knobs."""
    from detrl.algos.advantages import ADV_ESTIMATORS, SCALE_REWARDS
    from detrl.algos.core import KL_TYPES, LOSS_AGG_MODES
    from detrl.algos.kl import KL_CTRL_TYPES
    from detrl.algos.policy_loss import POLICY_LOSSES

    choice("algo.adv_estimator", a.adv_estimator, tuple(ADV_ESTIMATORS))
    choice("algo.policy_loss", a.policy_loss, tuple(POLICY_LOSSES))
    choice("algo.scale_rewards", a.scale_rewards, SCALE_REWARDS)
    check(
        a.norm_adv_by_std or a.scale_rewards != "batch",
        "algo.scale_rewards",
        a.scale_rewards,
        "algo.norm_adv_by_std=false already means none (no division); drop one of the two",
    )
    choice("algo.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    choice("algo.kl_loss_type", a.kl_loss_type, KL_TYPES)
    choice("algo.kl_penalty", a.kl_penalty, KL_TYPES)
    choice("algo.kl_ctrl.type", a.kl_ctrl.type, KL_CTRL_TYPES)
    check(a.kl_ctrl.horizon > 0, "algo.kl_ctrl.horizon", a.kl_ctrl.horizon, "must be > 0")
    check(a.kl_ctrl.target_kl > 0, "algo.kl_ctrl.target_kl", a.kl_ctrl.target_kl, "must be > 0")
    check(0 <= a.gamma <= 1, "algo.gamma", a.gamma, "must be in [0, 1]")
    p = a.policy_loss_args
    check(
        p.tau_pos > 0 and p.tau_neg > 0,
        "algo.policy_loss_args.tau_pos",
        p.tau_pos,
        "tau_pos, tau_neg must be > 0",
    )
    check(
        0 < p.clip_cov_ratio <= 1,
        "algo.policy_loss_args.clip_cov_ratio",
        p.clip_cov_ratio,
        "must be in (0, 1]",
    )
    check(0 < p.kl_cov_ratio <= 1, "algo.policy_loss_args.kl_cov_ratio", p.kl_cov_ratio, "must be in (0, 1]")
    if a.use_kl_in_reward:
        check(
            a.old_logprobs == "recompute",
            "algo.old_logprobs",
            a.old_logprobs,
            "must be recompute with algo.use_kl_in_reward=true (the reward needs the old logprobs first)",
        )


def _validate_correction(a: AlgoConfig) -> None:
    """algo.rollout_correction and its parameters (detrl.algos.rollout_correction owns the rules)."""
    from detrl.algos.rollout_correction import MODES
    from detrl.algos.rollout_correction import validate as validate_correction

    choice("algo.rollout_correction", a.rollout_correction, MODES)
    try:
        validate_correction(a.rollout_correction, **vars(a.rollout_corr), prefix="algo.rollout_corr")
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _validate_bounds(a: AlgoConfig) -> None:
    """The clip ratios, overlong buffer, dynamic sampling and loss scale, each on its own."""
    from detrl.collect import FILTER_METRICS

    check(a.clip_ratio_c > 1.0, "algo.clip_ratio_c", a.clip_ratio_c, "must be > 1")
    check(0 <= a.clip_ratio_low < 1, "algo.clip_ratio_low", a.clip_ratio_low, "must be in [0, 1)")
    check(a.clip_ratio_high >= 0, "algo.clip_ratio_high", a.clip_ratio_high, "must be >= 0")
    check(a.overlong.buffer_len >= 0, "algo.overlong.buffer_len", a.overlong.buffer_len, "must be >= 0")
    check(
        a.filter_groups.max_num_gen_batches >= 0,
        "algo.filter_groups.max_num_gen_batches",
        a.filter_groups.max_num_gen_batches,
        "must be >= 0 (0 = no limit)",
    )
    choice("algo.filter_groups.metric", a.filter_groups.metric, FILTER_METRICS)
    check(
        a.loss_scale_factor is None or a.loss_scale_factor > 0,
        "algo.loss_scale_factor",
        a.loss_scale_factor,
        "must be > 0 (or null = rollout.max_new_tokens)",
    )
    check(a.ppo_epochs >= 1, "algo.ppo_epochs", a.ppo_epochs, "must be >= 1")


def _validate_old_logprobs(a: AlgoConfig) -> None:
    """algo.old_logprobs (detrl.actor's strategies); `current` has no old logprobs before the loss."""
    from detrl.actor.old_pass import OLD_LOGPROBS

    choice("algo.old_logprobs", a.old_logprobs, OLD_LOGPROBS)
    if a.old_logprobs != "current":
        return
    check(a.ppo_epochs == 1, "algo.ppo_epochs", a.ppo_epochs, "must be 1 with algo.old_logprobs=current")
    check(
        a.rollout_correction == "none",
        "algo.rollout_correction",
        a.rollout_correction,
        "must be none with algo.old_logprobs=current (its weights need every old logprob before the loss)",
    )
    check(
        not a.rollout_corr.rollout_rs,
        "algo.rollout_corr.rollout_rs",
        a.rollout_corr.rollout_rs,
        "must be empty with algo.old_logprobs=current (rejection needs every old logprob before the loss)",
    )
