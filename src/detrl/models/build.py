"""Build a tiny Qwen3 / Qwen3-MoE from config on CPU, or load a local Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from detrl.config import ConfigError, ModelConfig


def hf_config(cfg: ModelConfig):
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if cfg.name == "qwen3":
        return Qwen3Config(intermediate_size=cfg.intermediate_size, **common)
    return Qwen3MoeConfig(
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, **common,
    )


def build_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """A fresh model initialised from `seed` (or loaded from cfg.path), float32, on CPU."""
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.path!r} is not a Hugging Face checkpoint dir (no config.json)")
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    cls = Qwen3ForCausalLM if cfg.name == "qwen3" else Qwen3MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(hf_config(cfg))
    return model.float()
