"""Build a tiny Qwen3 / Qwen3-MoE from config on CPU, or load a local Hugging Face checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from detrl.config.base import ConfigError
from detrl.config.model import ARCHITECTURES

if TYPE_CHECKING:  # annotations only: the config's validation imports this module
    from detrl.config import ModelConfig

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def hf_config(cfg: ModelConfig):
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if cfg.name == "qwen3":
        config = Qwen3Config(intermediate_size=cfg.intermediate_size, **common)
    else:
        config = Qwen3MoeConfig(
            intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            **common,
        )
    if cfg.attn_implementation is not None:
        config._attn_implementation = cfg.attn_implementation
    return config


def checkpoint_architecture(path: str | Path, need_tokenizer: bool = False) -> str:
    """Check a local checkpoint dir; -> detrl's model name (qwen3 | qwen3_moe). One line naming what is missing."""
    p = Path(path)
    key = f"model.path={str(path)!r}"
    if not p.is_dir():
        raise ConfigError(f"{key}: no such directory")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any((p / f).is_file() for f in WEIGHT_FILES) and not any(p.glob("*.safetensors")):
        missing.append("model weights (model.safetensors, model-*.safetensors + index, or pytorch_model.bin)")
    if need_tokenizer and not any((p / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json / tokenizer_config.json)")
    if missing:
        raise ConfigError(f"{key} is not a usable Hugging Face checkpoint: missing {', '.join(missing)}")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: config.json is not valid JSON ({e})") from None
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        archs = config.get("architectures") or [model_type]
        raise ConfigError(
            f"{key}: architecture {archs[0]!r} (model_type {model_type!r}) is not supported; "
            "detrl runs Qwen3ForCausalLM (qwen3) and Qwen3MoeForCausalLM (qwen3_moe)"
        )
    return ARCHITECTURES[model_type]


def build_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """A fresh model initialised from `seed` (or loaded from cfg.path), float32, on CPU."""
    if cfg.path is not None:
        checkpoint_architecture(cfg.path)
        kwargs = {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}
        return AutoModelForCausalLM.from_pretrained(
            str(cfg.path), local_files_only=True, dtype=torch.float32, **kwargs
        )
    cls = Qwen3ForCausalLM if cfg.name == "qwen3" else Qwen3MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(hf_config(cfg))
    return model.float()
