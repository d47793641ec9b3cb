"""Typed config schemas, registered in Hydra's ConfigStore.

`conf/train.yaml` starts from `train_schema`, so every group file is validated against these
dataclasses at compose time: a typo'd key or a value of the wrong type fails before anything runs.
Cross-field rules Hydra cannot express live in `validate()`, which raises `ConfigError` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A bad setting. Its message is one line naming the value and the valid choices."""


@dataclass
class ModelConfig:
    name: str = "qwen3"  # qwen3 (dense) | qwen3_moe
    path: str | None = None  # local Hugging Face checkpoint dir (offline from_pretrained)
    init: str = "warmstart"  # warmstart (a short SFT the project makes and caches) | random
    vocab_size: int = 64
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = False
    # the Hugging Face attention kernel of the transformers model (eager | sdpa | flash_attention_2; None = its
    # default). detrl's sampler and trainer run their own functional forward, so this only matters to code
    # that calls the transformers module itself (e.g. an SGLang / HF export or a reference check)
    attn_implementation: str | None = None
    # MoE only (qwen3_moe)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    dtype: str = (
        "auto"  # compute dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    )


@dataclass
class WarmstartConfig:
    steps: int = 150  # SFT steps on the task; small on purpose so that RL has room to improve
    lr: float = 3e-3
    batch_size: int = 64
    label_smoothing: float = 0.65  # a broad policy whose argmax is mostly right: RL sharpens it
    seed: int = 1234  # independent of the run seed: all runs of a sweep share one warm start


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


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule, as verl's actor.optim (lr, weight_decay, grad_clip stay top level).

    The schedule is a function of the trainer step (verl steps its scheduler once per rollout batch), so
    an exact resume needs no scheduler state."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    lr_scheduler_type: str = "constant"  # constant | cosine (both with linear warmup)
    lr_warmup_steps: int = -1  # < 0: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # of `steps`
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    num_cycles: float = 0.5  # cosine waves over the post-warmup steps (0.5 = a half cosine down)
    # optimizer steps with a NaN / inf gradient norm are skipped (as verl); this many in a row stop the run
    max_nonfinite_grad_steps: int = 5


@dataclass
class DeterminismConfig:
    """The preset (conf/determinism/{on,off}.yaml) and the value of each source of nondeterminism; the values
    and what each means: detrl.determinism.SOURCES. One override flips one source:
    `python train.py determinism=on determinism.kernels=default`."""

    name: str = "on"  # the preset the values started from: on | off
    sampling: str = "seeded"  # seeded | stream
    routing: str = "fixed"  # fixed | dynamic
    kernels: str = "batch_invariant"  # batch_invariant | default
    order: str = "submission"  # submission | completion
    moe_routing: str = "stable"  # stable | topk
    torch_algorithms: str = "deterministic"  # deterministic | default
    cut: str = "token_budget"  # partial rollout: token_budget | async
    reduce: str = "ordered"  # torchrun gradients: ordered | all_reduce


@dataclass
class PartialRolloutConfig:
    enabled: bool = False
    # determinism.cut=token_budget: new tokens per pending sample per generation round (the cut). Each round re-prefills prompt +
    # prefix, so a budget of 1 costs O(length^2): 0 = auto, ceil(rollout.max_new_tokens / ROUNDS_PER_RESPONSE)
    token_budget: int = 0
    oversample: float = 1.5  # prompt groups in flight per step, as a multiple of train_batch_size
    max_staleness: int = (
        2  # an unfinished sample whose oldest token is older than this many versions restarts
    )
    stale_tokens: str = "keep"  # keep (importance ratio vs the behaviour logprobs) | mask | rescore
    off_cut: str = "groups"  # determinism.cut=async: cut when the first groups finish (groups) or at a wall-clock budget (time)
    time_budget_s: float = 0.05  # off_cut=time: seconds of generation per call before the cut


@dataclass
class SGLangConfig:
    urls: list[str] = field(
        default_factory=list
    )  # attach to running servers (SGLang or python -m detrl.serve)
    num_servers: int = 1  # servers to launch when urls is empty
    gpu_ids: list[list[int]] = field(default_factory=list)  # per server (CUDA_VISIBLE_DEVICES); [] = inherit
    tp_size: int = 1
    port: int = 30000  # first port; server i listens on port + i
    attention_backend: str = "fa3"  # with determinism on: fa3 (Hopper), flashinfer or triton
    rl_on_policy_target: bool = (
        False  # adds --rl-on-policy-target fsdp (checked against the installed SGLang)
    )
    health_timeout_s: float = 120.0  # attached or launched servers; progress printed every 30 s
    timeout_s: float = 120.0
    retries: int = 3


@dataclass
class RolloutConfig:
    backend: str = "embedded"  # embedded | sglang
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    num_workers: int = 2  # engine worker processes (replicas), each batching what is routed to it
    max_batch_size: int = 128  # requests per engine batch (continuous: running sequences per worker)
    scheduler: str = "continuous"  # continuous (paged KV, prefix sharing) | static (the baseline's batches)
    block_size: int = 8  # KV tokens per pool block
    prefill_chunk: int = 64  # prompt tokens a sequence prefills per step
    kv_pool_tokens: int = (
        0  # KV tokens per worker pool; 0 = max_batch_size x ctx_len within half the free memory
    )
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class DataConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | math (src/detrl/data/registry.py)
    # arithmetic only
    min_operand: int = 0
    max_operand: int = 9
    ops: list[str] = field(default_factory=lambda: ["+"])
    # held-out share of the rows for evaluation when data.eval_path is not given (chosen by the seed)
    eval_fraction: float = 0.0
    # gsm8k / math: local files read through `datasets` (a .parquet / .jsonl / .json file, or a dir of them)
    path: str | None = None
    eval_path: str | None = None
    prompt_key: str | None = (
        None  # column of the prompt (a dotted path reaches into a struct); None: the task's default
    )
    answer_key: str | None = None  # column of the gold answer; None: the task's default
    prompt_template: str | None = None  # "{prompt}" stands for the row's prompt; None: the task's default
    chat_template: bool = False  # render prompts with the tokenizer's chat template
    enable_thinking: bool | None = (
        None  # passed to the chat template (Qwen3's thinking switch); None: not passed
    )
    system_prompt: str | None = None
    max_prompt_length: int = 0  # prompts longer than this many tokens are left out (0 = keep all)
    shuffle: bool = True  # file tasks: the training order is a seeded shuffle of the rows
    gsm8k_method: str = "flexible"  # strict (only "#### N") | flexible (then \\boxed{}, then the last number)
    reward_timeout_s: float = 5.0  # a sample's reward running longer scores 0 and counts in reward/errors
    reward_workers: int = 0  # gsm8k / math: processes scoring each group's responses (0: the trainer's own)


@dataclass
class EvalConfig:
    every: int = 0  # evaluate on the eval split every N steps (and at the last step); 0 = never
    n: int = 1  # samples per eval prompt
    greedy: bool = True  # greedy decoding; false: sample with eval.temperature / eval.top_p
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompts: int = 0  # evaluate on the first N prompts of the eval split (0 = all)
    batch_prompts: int = 64  # prompts per engine call (the progress bar advances per call)


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # wandb | none (metrics.jsonl is always written)
    project: str = "detrl"
    entity: str | None = None
    group: str | None = None  # default: the sweep / experiment name
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # offline unless WANDB_MODE or this says otherwise


@dataclass
class CheckpointConfig:
    every: int = 0  # exact-resume checkpoint every N steps (0 = only at the end)
    keep_last: int = 2  # exact-resume checkpoints kept
    allow_config_change: bool = False  # resume even when the config differs from the checkpoint's
    save_final: bool = True  # also save the final policy in Hugging Face format (checkpoint-final/)
    at_end: bool = (
        True  # the exact-resume checkpoint at the last step (false: benchmarks at scale, no resume)
    )


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    determinism: DeterminismConfig = MISSING
    rollout: RolloutConfig = MISSING
    data: DataConfig = MISSING
    logger: LoggerConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    experiment: str | None = None  # name of the experiment preset / study
    device: str = "auto"  # auto (CUDA when available) | cpu | cuda
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward (trainer)
    seed: int = 0
    repeat: int = 0  # replicate index: changes the run name only
    steps: int = 60
    train_batch_size: int = 32  # prompts per step
    micro_batch_size: int = 64  # sequences per backward pass (gradient accumulation inside a step)
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    run_dir: str | None = None  # default: Hydra's output dir
    resume: str | None = (
        None  # auto (latest checkpoint in run_dir, else start fresh) | a run or checkpoint dir
    )
    # per-decoder-layer digests of a fixed canary batch (fp/layers/<i>) every N steps (0 = never);
    # `python -m detrl.forensics RUN_A RUN_B` localises where two runs' weights part
    layer_digests_every: int = 0


@dataclass
class ProbeConfig(TrainConfig):
    trials: int = 50  # batches per probe mode


MODEL_NAMES = ("qwen3", "qwen3_moe")
ALGO_NAMES = ("grpo", "dapo", "gspo", "rloo")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
ROLLOUT_BACKENDS = ("embedded", "sglang")
LOGGER_BACKENDS = ("wandb", "none")
MODEL_INITS = ("warmstart", "random")


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    ConfigStore.instance().store(name="probe_schema", node=ProbeConfig)


def _choice(where: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {list(choices)}")


def _check(ok: bool, where: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{where}={value!r} is not valid: {rule}")


def _validate_algo_variants(a: AlgoConfig) -> None:
    """The registry-chosen names (each registry is the one list of choices) and their knobs."""
    from detrl.algos.advantages import ADV_ESTIMATORS, SCALE_REWARDS
    from detrl.algos.core import KL_TYPES, LOSS_AGG_MODES
    from detrl.algos.kl import KL_CTRL_TYPES
    from detrl.algos.policy_loss import POLICY_LOSSES

    _choice("algo.adv_estimator", a.adv_estimator, tuple(ADV_ESTIMATORS))
    _choice("algo.policy_loss", a.policy_loss, tuple(POLICY_LOSSES))
    _choice("algo.scale_rewards", a.scale_rewards, SCALE_REWARDS)
    _check(
        a.norm_adv_by_std or a.scale_rewards != "batch",
        "algo.scale_rewards",
        a.scale_rewards,
        "algo.norm_adv_by_std=false already means none (no division); drop one of the two",
    )
    _choice("algo.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _choice("algo.kl_loss_type", a.kl_loss_type, KL_TYPES)
    _choice("algo.kl_penalty", a.kl_penalty, KL_TYPES)
    _choice("algo.kl_ctrl.type", a.kl_ctrl.type, KL_CTRL_TYPES)
    _check(a.kl_ctrl.horizon > 0, "algo.kl_ctrl.horizon", a.kl_ctrl.horizon, "must be > 0")
    _check(a.kl_ctrl.target_kl > 0, "algo.kl_ctrl.target_kl", a.kl_ctrl.target_kl, "must be > 0")
    _check(0 <= a.gamma <= 1, "algo.gamma", a.gamma, "must be in [0, 1]")
    p = a.policy_loss_args
    _check(
        p.tau_pos > 0 and p.tau_neg > 0,
        "algo.policy_loss_args.tau_pos",
        p.tau_pos,
        "tau_pos, tau_neg must be > 0",
    )
    _check(
        0 < p.clip_cov_ratio <= 1,
        "algo.policy_loss_args.clip_cov_ratio",
        p.clip_cov_ratio,
        "must be in (0, 1]",
    )
    _check(0 < p.kl_cov_ratio <= 1, "algo.policy_loss_args.kl_cov_ratio", p.kl_cov_ratio, "must be in (0, 1]")
    if a.use_kl_in_reward:
        _check(
            a.old_logprobs == "recompute",
            "algo.old_logprobs",
            a.old_logprobs,
            "must be recompute with algo.use_kl_in_reward=true (the reward needs the old logprobs first)",
        )


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks; raises ConfigError (one line) on the first bad value."""
    from detrl.guards import check_values

    check_values(cfg)  # values no run accepts (non-finite, zero sizes, empty groups): detrl.guards
    m, a, r = cfg.model, cfg.algo, cfg.rollout
    _choice("algo.rollout_correction", a.rollout_correction, ("none", "tis", "mis"))
    from detrl.algos.rollout_correction import validate as _validate_correction

    try:
        _validate_correction(a.rollout_correction, **vars(a.rollout_corr), prefix="algo.rollout_corr")
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    _check(
        cfg.layer_digests_every >= 0,
        "layer_digests_every",
        cfg.layer_digests_every,
        "must be >= 0 (0 = never)",
    )
    _choice("model.name", m.name, MODEL_NAMES)
    _choice("model.init", m.init, MODEL_INITS)
    _choice("model.dtype", m.dtype, ("auto", "float32", "bfloat16", "float16"))
    _choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _check(
        m.num_attention_heads % m.num_key_value_heads == 0,
        "model.num_key_value_heads",
        m.num_key_value_heads,
        "must divide model.num_attention_heads",
    )
    if m.name == "qwen3_moe":
        _check(
            1 <= m.num_experts_per_tok <= m.num_experts,
            "model.num_experts_per_tok",
            m.num_experts_per_tok,
            f"must be in [1, model.num_experts={m.num_experts}]",
        )
    _choice("algo.name", a.name, ALGO_NAMES)
    if a.routing_replay:
        _check(
            m.name == "qwen3_moe",
            "algo.routing_replay",
            a.routing_replay,
            f"model={m.name} is dense, it has no expert routing to replay (use model=qwen3_moe)",
        )
        _check(
            r.backend == "embedded",
            "algo.routing_replay",
            a.routing_replay,
            f"rollout={r.backend} does not record expert ids (use rollout=embedded)",
        )
    _validate_algo_variants(a)
    _check(a.clip_ratio_c > 1.0, "algo.clip_ratio_c", a.clip_ratio_c, "must be > 1")
    _check(0 <= a.clip_ratio_low < 1, "algo.clip_ratio_low", a.clip_ratio_low, "must be in [0, 1)")
    _check(a.clip_ratio_high >= 0, "algo.clip_ratio_high", a.clip_ratio_high, "must be >= 0")
    _check(a.overlong.buffer_len >= 0, "algo.overlong.buffer_len", a.overlong.buffer_len, "must be >= 0")
    _check(
        a.overlong.buffer_len < r.max_new_tokens or not a.overlong.enabled,
        "algo.overlong.buffer_len",
        a.overlong.buffer_len,
        f"must be < rollout.max_new_tokens={r.max_new_tokens}",
    )
    _check(
        a.filter_groups.max_num_gen_batches >= 0,
        "algo.filter_groups.max_num_gen_batches",
        a.filter_groups.max_num_gen_batches,
        "must be >= 0 (0 = no limit)",
    )
    _choice("algo.filter_groups.metric", a.filter_groups.metric, FILTER_METRICS)
    _check(
        a.loss_scale_factor is None or a.loss_scale_factor > 0,
        "algo.loss_scale_factor",
        a.loss_scale_factor,
        "must be > 0 (or null = rollout.max_new_tokens)",
    )
    _check(a.ppo_epochs >= 1, "algo.ppo_epochs", a.ppo_epochs, "must be >= 1")
    _check(
        a.gen_batch_size == 0 or a.gen_batch_size >= cfg.train_batch_size,
        "algo.gen_batch_size",
        a.gen_batch_size,
        f"must be 0 (= train_batch_size) or >= train_batch_size={cfg.train_batch_size}",
    )
    mini = a.ppo_mini_batch_size
    _check(
        mini >= 0 and (mini == 0 or mini >= cfg.train_batch_size or cfg.train_batch_size % mini == 0),
        "algo.ppo_mini_batch_size",
        mini,
        f"must divide train_batch_size={cfg.train_batch_size} (prompts; 0 or >= it = the whole batch)",
    )
    _choice("algo.old_logprobs", a.old_logprobs, ("recompute", "current"))
    if a.old_logprobs == "current":
        _check(a.ppo_epochs == 1, "algo.ppo_epochs", a.ppo_epochs, "must be 1 with algo.old_logprobs=current")
        _check(
            mini == 0 or mini >= cfg.train_batch_size,
            "algo.ppo_mini_batch_size",
            mini,
            f"must be 0 or >= train_batch_size={cfg.train_batch_size} (one mini-batch) with algo.old_logprobs=current",
        )
        _check(
            a.rollout_correction == "none",
            "algo.rollout_correction",
            a.rollout_correction,
            "must be none with algo.old_logprobs=current (its weights need every old logprob before the loss)",
        )
        _check(
            not a.rollout_corr.rollout_rs,
            "algo.rollout_corr.rollout_rs",
            a.rollout_corr.rollout_rs,
            "must be empty with algo.old_logprobs=current (rejection needs every old logprob before the loss)",
        )
    _check(
        cfg.determinism.name in ("on", "off"),
        "determinism",
        cfg.determinism.name,
        "choose one of ['on', 'off']",
    )
    _choice("rollout.backend", r.backend, ROLLOUT_BACKENDS)
    from detrl.determinism import check as _check_determinism

    try:
        _check_determinism(vars(cfg.determinism), partial=r.partial.enabled, backend=r.backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if r.backend == "sglang":
        _check(r.sglang.num_servers >= 1, "rollout.sglang.num_servers", r.sglang.num_servers, "must be >= 1")
        _choice(
            "rollout.sglang.attention_backend", r.sglang.attention_backend, ("fa3", "flashinfer", "triton")
        )
    _check(r.n >= 1, "rollout.n", r.n, "must be >= 1")
    _check(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0")
    _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "must be >= 1")
    _check(r.num_workers >= 1, "rollout.num_workers", r.num_workers, "must be >= 1")
    _check(r.max_batch_size >= 1, "rollout.max_batch_size", r.max_batch_size, "must be >= 1")
    from detrl.rollout.batching import SCHEDULERS

    _choice("rollout.scheduler", r.scheduler, SCHEDULERS)
    for key in ("block_size", "prefill_chunk"):
        _check(getattr(r, key) >= 1, f"rollout.{key}", getattr(r, key), "must be >= 1")
    _check(r.kv_pool_tokens >= 0, "rollout.kv_pool_tokens", r.kv_pool_tokens, "must be >= 0 (0 = auto)")
    _check(
        r.partial.token_budget >= 0,
        "rollout.partial.token_budget",
        r.partial.token_budget,
        "must be >= 0 (0 = auto: max_new_tokens / 4 a round)",
    )
    _check(r.partial.oversample >= 1.0, "rollout.partial.oversample", r.partial.oversample, "must be >= 1")
    _check(
        r.partial.max_staleness >= 0, "rollout.partial.max_staleness", r.partial.max_staleness, "must be >= 0"
    )
    _choice("rollout.partial.stale_tokens", r.partial.stale_tokens, ("keep", "mask", "rescore"))
    _choice("rollout.partial.off_cut", r.partial.off_cut, ("groups", "time"))
    _check(
        r.partial.time_budget_s > 0, "rollout.partial.time_budget_s", r.partial.time_budget_s, "must be > 0"
    )
    _choice("data.name", cfg.data.name, ("arithmetic", "gsm8k", "math"))
    d, ev = cfg.data, cfg.eval
    if d.name != "arithmetic":
        _check(
            d.path is not None,
            "data.path",
            d.path,
            f"data={d.name} reads local files: set data.path=/file/or/dir",
        )
        _check(
            m.path is not None or m.init == "random",
            "model.init",
            m.init,
            f"the warm start is for data=arithmetic; with data={d.name} set model.path=/hf/dir or model.init=random",
        )
    _check(0 <= d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be in [0, 1)")
    _choice("data.gsm8k_method", d.gsm8k_method, ("strict", "flexible"))
    _check(
        d.max_prompt_length >= 0, "data.max_prompt_length", d.max_prompt_length, "must be >= 0 (0 = keep all)"
    )
    _check(
        d.reward_timeout_s >= 0, "data.reward_timeout_s", d.reward_timeout_s, "must be >= 0 (0 = no limit)"
    )
    _check(
        d.reward_workers >= 0,
        "data.reward_workers",
        d.reward_workers,
        "must be >= 0 (0 = score in the trainer)",
    )
    _check(ev.every >= 0, "eval.every", ev.every, "must be >= 0 (0 = never)")
    _check(ev.n >= 1, "eval.n", ev.n, "must be >= 1")
    _check(ev.temperature > 0, "eval.temperature", ev.temperature, "must be > 0")
    _check(0 < ev.top_p <= 1, "eval.top_p", ev.top_p, "must be in (0, 1]")
    _check(ev.max_prompts >= 0, "eval.max_prompts", ev.max_prompts, "must be >= 0 (0 = all)")
    _check(ev.batch_prompts >= 1, "eval.batch_prompts", ev.batch_prompts, "must be >= 1")
    _check(
        ev.every == 0 or d.name == "arithmetic" or d.eval_path is not None or d.eval_fraction > 0,
        "eval.every",
        ev.every,
        "needs an eval split: set data.eval_path or data.eval_fraction > 0",
    )
    _choice(
        "model.attn_implementation",
        m.attn_implementation,
        (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
    )
    _check(
        set(cfg.data.ops) <= {"+", "-", "*"} and len(cfg.data.ops) > 0,
        "data.ops",
        list(cfg.data.ops),
        "choose a non-empty subset of ['+', '-', '*']",
    )
    _check(
        0 <= cfg.data.min_operand <= cfg.data.max_operand,
        "data.max_operand",
        cfg.data.max_operand,
        f"must be >= data.min_operand={cfg.data.min_operand} >= 0",
    )
    _choice("logger.backend", cfg.logger.backend, LOGGER_BACKENDS)
    _check(cfg.steps >= 0, "steps", cfg.steps, "must be >= 0")
    _check(cfg.train_batch_size >= 1, "train_batch_size", cfg.train_batch_size, "must be >= 1")
    _check(cfg.micro_batch_size >= 1, "micro_batch_size", cfg.micro_batch_size, "must be >= 1")
    _check(cfg.lr > 0, "lr", cfg.lr, "must be > 0")
    _check(cfg.grad_clip >= 0, "grad_clip", cfg.grad_clip, "must be >= 0")
    _check(cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "must be >= 0")
    o = cfg.optim
    _check(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optim.betas",
        list(o.betas),
        "must be two values in [0, 1)",
    )
    _choice("optim.lr_scheduler_type", o.lr_scheduler_type, ("constant", "cosine"))
    _check(
        0 <= o.lr_warmup_steps_ratio <= 1,
        "optim.lr_warmup_steps_ratio",
        o.lr_warmup_steps_ratio,
        "must be in [0, 1]",
    )
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _check(
        cfg.checkpoint.every >= 0,
        "checkpoint.every",
        cfg.checkpoint.every,
        "must be >= 0 (0 = only at the end)",
    )
    _check(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "must be >= 1")


def check_keys(node: DictConfig, where: str = "") -> None:
    """Refuse a key the schema lacks: `+model.hidden_sizee=256` (Hydra's hint for a typo) adds it past the
    struct check, and to_object would drop it without a word."""
    import dataclasses
    import difflib

    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items_ex(resolve=False):
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {where}{near[0]}? " if near else ""
            raise ConfigError(
                f"unknown key {where}{key}: {hint}{where.rstrip('.') or 'the config'} has {names}"
            )
        if isinstance(value, DictConfig):
            check_keys(value, f"{where}{key}.")


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Convert the composed DictConfig into the dataclass tree, once, at the entrypoint."""
    check_keys(cfg)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    validate(typed)
    return typed
