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
    # MoE only (qwen3_moe)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    dtype: str = "auto"  # compute dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16


@dataclass
class WarmstartConfig:
    steps: int = 150  # SFT steps on the task; small on purpose so that RL has room to improve
    lr: float = 3e-3
    batch_size: int = 64
    label_smoothing: float = 0.65  # a broad policy whose argmax is mostly right: RL sharpens it
    seed: int = 1234  # independent of the run seed: all runs of a sweep share one warm start


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False
    max_num_gen_batches: int = 10  # 0 = no limit


@dataclass
class OverlongConfig:
    enabled: bool = False
    buffer_len: int = 2
    penalty_factor: float = 1.0


@dataclass
class AlgoConfig:
    name: str = "grpo"  # grpo | dapo
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # false = Dr. GRPO
    adv_epsilon: float = 1e-6
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip for negative advantages (> 1)
    loss_agg_mode: str = "seq-mean-token-mean"
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class DeterminismConfig:
    name: str = "on"  # on | off
    enabled: bool = True


@dataclass
class PartialRolloutConfig:
    enabled: bool = False
    token_budget: int = 1  # determinism on: new tokens per pending sample per generation round (the cut)
    oversample: float = 1.5  # prompt groups in flight per step, as a multiple of train_batch_size
    max_staleness: int = 2  # an unfinished sample whose oldest token is older than this many versions restarts
    stale_tokens: str = "keep"  # keep (importance ratio vs the behaviour logprobs) | mask | rescore
    off_cut: str = "groups"  # determinism off: cut when the first groups finish (groups) or at a wall-clock budget (time)
    time_budget_s: float = 0.05  # off_cut=time: seconds of generation per call before the cut


@dataclass
class SGLangConfig:
    urls: list[str] = field(default_factory=list)  # attach to running servers (SGLang or python -m detrl.serve)
    num_servers: int = 1  # servers to launch when urls is empty
    gpu_ids: list[list[int]] = field(default_factory=list)  # per server (CUDA_VISIBLE_DEVICES); [] = inherit
    tp_size: int = 1
    port: int = 30000  # first port; server i listens on port + i
    attention_backend: str = "fa3"  # with determinism on: fa3 (Hopper), flashinfer or triton
    rl_on_policy_target: bool = False  # adds --rl-on-policy-target fsdp (checked against the installed SGLang)
    health_timeout_s: float = 600.0
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
    max_batch_size: int = 128  # requests per engine batch
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class DataConfig:
    name: str = "arithmetic"
    min_operand: int = 0
    max_operand: int = 9
    ops: list[str] = field(default_factory=lambda: ["+"])
    eval_fraction: float = 0.0


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


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    determinism: DeterminismConfig = MISSING
    rollout: RolloutConfig = MISSING
    data: DataConfig = MISSING
    logger: LoggerConfig = MISSING
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
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
    resume: str | None = None  # auto (latest checkpoint in run_dir, else start fresh) | a run or checkpoint dir


@dataclass
class ProbeConfig(TrainConfig):
    trials: int = 50  # batches per probe mode


MODEL_NAMES = ("qwen3", "qwen3_moe")
ALGO_NAMES = ("grpo", "dapo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
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


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks; raises ConfigError (one line) on the first bad value."""
    m, a, r = cfg.model, cfg.algo, cfg.rollout
    _choice("model.name", m.name, MODEL_NAMES)
    _choice("model.init", m.init, MODEL_INITS)
    _choice("model.dtype", m.dtype, ("auto", "float32", "bfloat16"))
    _choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _check(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
           m.num_key_value_heads, "must divide model.num_attention_heads")
    if m.name == "qwen3_moe":
        _check(1 <= m.num_experts_per_tok <= m.num_experts, "model.num_experts_per_tok",
               m.num_experts_per_tok, f"must be in [1, model.num_experts={m.num_experts}]")
    _choice("algo.name", a.name, ALGO_NAMES)
    _choice("algo.adv_estimator", a.adv_estimator, ("grpo",))
    _choice("algo.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _choice("algo.kl_loss_type", a.kl_loss_type, KL_TYPES)
    _check(a.clip_ratio_c > 1.0, "algo.clip_ratio_c", a.clip_ratio_c, "must be > 1")
    _check(0 <= a.clip_ratio_low < 1, "algo.clip_ratio_low", a.clip_ratio_low, "must be in [0, 1)")
    _check(a.clip_ratio_high >= 0, "algo.clip_ratio_high", a.clip_ratio_high, "must be >= 0")
    _check(a.overlong.buffer_len >= 0, "algo.overlong.buffer_len", a.overlong.buffer_len, "must be >= 0")
    _check(a.overlong.buffer_len < r.max_new_tokens or not a.overlong.enabled, "algo.overlong.buffer_len",
           a.overlong.buffer_len, f"must be < rollout.max_new_tokens={r.max_new_tokens}")
    _check(a.dynamic_sampling.max_num_gen_batches >= 0, "algo.dynamic_sampling.max_num_gen_batches",
           a.dynamic_sampling.max_num_gen_batches, "must be >= 0 (0 = no limit)")
    _check(cfg.determinism.name in ("on", "off"), "determinism", cfg.determinism.name, "choose one of ['on', 'off']")
    _choice("rollout.backend", r.backend, ROLLOUT_BACKENDS)
    if r.backend == "sglang":
        _check(r.sglang.num_servers >= 1, "rollout.sglang.num_servers", r.sglang.num_servers, "must be >= 1")
        _choice("rollout.sglang.attention_backend", r.sglang.attention_backend, ("fa3", "flashinfer", "triton"))
        _check(not (r.partial.enabled and cfg.determinism.name == "off"), "rollout.partial.enabled",
               r.partial.enabled, "with rollout=sglang the partial-rollout cut is the token budget: use determinism=on")
    _check(r.n >= 1, "rollout.n", r.n, "must be >= 1")
    _check(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0")
    _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "must be >= 1")
    _check(r.num_workers >= 1, "rollout.num_workers", r.num_workers, "must be >= 1")
    _check(r.max_batch_size >= 1, "rollout.max_batch_size", r.max_batch_size, "must be >= 1")
    _check(r.partial.token_budget >= 1, "rollout.partial.token_budget", r.partial.token_budget, "must be >= 1")
    _check(r.partial.oversample >= 1.0, "rollout.partial.oversample", r.partial.oversample, "must be >= 1")
    _check(r.partial.max_staleness >= 0, "rollout.partial.max_staleness", r.partial.max_staleness, "must be >= 0")
    _choice("rollout.partial.stale_tokens", r.partial.stale_tokens, ("keep", "mask", "rescore"))
    _choice("rollout.partial.off_cut", r.partial.off_cut, ("groups", "time"))
    _check(r.partial.time_budget_s > 0, "rollout.partial.time_budget_s", r.partial.time_budget_s, "must be > 0")
    _choice("data.name", cfg.data.name, ("arithmetic",))
    _check(set(cfg.data.ops) <= {"+", "-", "*"} and len(cfg.data.ops) > 0, "data.ops", list(cfg.data.ops),
           "choose a non-empty subset of ['+', '-', '*']")
    _check(0 <= cfg.data.min_operand <= cfg.data.max_operand, "data.max_operand", cfg.data.max_operand,
           f"must be >= data.min_operand={cfg.data.min_operand} >= 0")
    _choice("logger.backend", cfg.logger.backend, LOGGER_BACKENDS)
    _check(cfg.steps >= 0, "steps", cfg.steps, "must be >= 0")
    _check(cfg.train_batch_size >= 1, "train_batch_size", cfg.train_batch_size, "must be >= 1")
    _check(cfg.micro_batch_size >= 1, "micro_batch_size", cfg.micro_batch_size, "must be >= 1")
    _check(cfg.lr > 0, "lr", cfg.lr, "must be > 0")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every", cfg.checkpoint.every, "must be >= 0 (0 = only at the end)")
    _check(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "must be >= 1")


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Convert the composed DictConfig into the dataclass tree, once, at the entrypoint."""
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    validate(typed)
    return typed
