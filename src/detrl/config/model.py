"""The model group (`conf/model/*.yaml`) and the warm start's SFT settings."""

from __future__ import annotations

from dataclasses import dataclass

from detrl.config.base import check, choice

MODEL_INITS = ("warmstart", "random")
# config.json model_type -> detrl's model.name (here, not in models.build: validating a config must not load
# transformers' model code, ~5 s before a bad value's one-line error)
ARCHITECTURES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
# transformers' attention kernels a `model.attn_implementation` may name (None: the model's default)
ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


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

    def from_checkpoint(self) -> bool:
        """Whether the weights are loaded from a Hugging Face directory: model.path, or the warm start's cache
        (init=warmstart; `builder.checkpoint_dir` names the directory). False for a random init."""
        return self.path is not None or self.init == "warmstart"

    def validate(self) -> None:
        """Names from their registries, then the shape rules (heads, experts) and the attention kernel."""
        from detrl.device import DTYPES

        choice("model.name", self.name, dict.fromkeys(ARCHITECTURES.values()))
        choice("model.init", self.init, MODEL_INITS)
        choice("model.dtype", self.dtype, ("auto", *DTYPES))
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "model.num_key_value_heads",
            self.num_key_value_heads,
            "must divide model.num_attention_heads",
        )
        if self.name == "qwen3_moe":
            check(
                1 <= self.num_experts_per_tok <= self.num_experts,
                "model.num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be in [1, model.num_experts={self.num_experts}]",
            )
        choice("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)


@dataclass
class WarmstartConfig:
    steps: int = 150  # SFT steps on the task; small on purpose so that RL has room to improve
    lr: float = 3e-3
    batch_size: int = 64
    label_smoothing: float = 0.65  # a broad policy whose argmax is mostly right: RL sharpens it
    seed: int = 1234  # independent of the run seed: all runs of a sweep share one warm start

    def validate(self) -> None:
        """Its steps and lr are checked with every run's values (detrl.guards)."""
        check(self.batch_size >= 1, "warmstart.batch_size", self.batch_size, "must be >= 1")
        check(
            0 <= self.label_smoothing <= 1,
            "warmstart.label_smoothing",
            self.label_smoothing,
            "must be in [0, 1]",
        )
