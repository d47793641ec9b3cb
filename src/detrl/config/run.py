"""The run: its top-level keys, the optimizer, logging and checkpoints, and the tree of every group."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from detrl.config.algo import AlgoConfig
from detrl.config.base import check, choice
from detrl.config.data import DataConfig, EvalConfig
from detrl.config.determinism import DeterminismConfig
from detrl.config.model import ModelConfig, WarmstartConfig
from detrl.config.rollout import RolloutConfig

DEVICES = ("auto", "cpu", "cuda")
LOGGER_BACKENDS = ("wandb", "none")


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

    def validate(self) -> None:
        from detrl.algos.core import LR_SCHEDULERS

        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim.betas",
            list(self.betas),
            "must be two values in [0, 1)",
        )
        choice("optim.lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        check(
            0 <= self.lr_warmup_steps_ratio <= 1,
            "optim.lr_warmup_steps_ratio",
            self.lr_warmup_steps_ratio,
            "must be in [0, 1]",
        )
        check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


@dataclass
class LoggerConfig:
    backend: str = "wandb"  # wandb | none (metrics.jsonl is always written)
    project: str = "detrl"
    entity: str | None = None
    group: str | None = None  # default: the sweep / experiment name
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # offline unless WANDB_MODE or this says otherwise

    def validate(self) -> None:
        choice("logger.backend", self.backend, LOGGER_BACKENDS)


@dataclass
class CheckpointConfig:
    every: int = 0  # exact-resume checkpoint every N steps (0 = only at the end)
    keep_last: int = 2  # exact-resume checkpoints kept
    allow_config_change: bool = False  # resume even when the config differs from the checkpoint's
    save_final: bool = True  # also save the final policy in Hugging Face format (checkpoint-final/)
    at_end: bool = (
        True  # the exact-resume checkpoint at the last step (false: benchmarks at scale, no resume)
    )

    def validate(self) -> None:
        check(self.every >= 0, "checkpoint.every", self.every, "must be >= 0 (0 = only at the end)")
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1")


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

    def validate(self) -> None:
        """The whole tree: each group's own rules, then the cross-group ones (detrl.config.cross)."""
        from detrl.config.cross import validate

        validate(self)

    def validate_keys(self) -> None:
        """The run's own top-level keys (each group checks its own)."""
        check(
            self.layer_digests_every >= 0,
            "layer_digests_every",
            self.layer_digests_every,
            "must be >= 0 (0 = never)",
        )
        choice("device", self.device, DEVICES)
        check(self.steps >= 0, "steps", self.steps, "must be >= 0")
        for key in ("train_batch_size", "micro_batch_size"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        check(self.lr > 0, "lr", self.lr, "must be > 0")
        for key in ("grad_clip", "weight_decay"):
            check(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")


@dataclass
class ProbeConfig(TrainConfig):
    trials: int = 50  # batches per probe mode
