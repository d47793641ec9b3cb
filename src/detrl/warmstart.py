"""The default model's warm start: a short supervised pass on the task, built once and cached.

RL on a random tiny model would take minutes to find the answer format; a brief SFT gives a policy
that is right sometimes (mean reward ~0.2) so GRPO has signal from the first step. The cache key is
a hash of everything the SFT depends on, so a changed model or task builds a new one.
`python -m detrl.warmstart` builds it explicitly (Hydra overrides work: model=qwen3_moe, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from detrl.models.build import build_model
from detrl.models.forward import forward, rope_tables
from detrl.models.ops import DEFAULT_OPS

if TYPE_CHECKING:  # annotations only: the config's validation reaches this module through the data registry
    from detrl.config import DataConfig, ModelConfig, WarmstartConfig

from .determinism import stable_hash

_SFT_DATA_KEYS = ("name", "min_operand", "max_operand", "ops", "eval_fraction")


def cache_root() -> Path:
    return Path(os.environ.get("DETRL_CACHE_DIR", Path.home() / ".cache" / "detrl"))


def warmstart_dir(
    model_cfg: ModelConfig, data_cfg: DataConfig, ws: WarmstartConfig, tokenizer, device: str = "cpu"
) -> Path:
    arch = {
        k: v
        for k, v in dataclasses.asdict(model_cfg).items()
        if k not in ("path", "init", "attn_implementation")
    }
    # the arithmetic task's fields only (the SFT's data): later data options leave existing caches valid
    data = {k: v for k, v in dataclasses.asdict(data_cfg).items() if k in _SFT_DATA_KEYS}
    parts = [arch, data, dataclasses.asdict(ws), tokenizer.get_vocab(), torch.__version__]
    if device != "cpu":  # another device's SFT gives other bits (CPU keys stay as they were)
        parts.append(device)
    key = json.dumps(
        parts,
        sort_keys=True,
        default=str,
    )
    return cache_root() / "warmstart" / f"{model_cfg.name}-{stable_hash(key):016x}"


def encode(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]


def sft(model, tokenizer, task, ws: WarmstartConfig, ctx_len: int, device: str = "cpu") -> None:
    """Teacher-forced cross-entropy on `prompt answer <eos>`, loss on the answer tokens only, on `device`
    (a GPU run warm-starts its large shapes there; the model comes back to the CPU)."""
    gen = torch.Generator().manual_seed(ws.seed)
    model.to(device)
    rope = tuple(t.to(device) for t in rope_tables(model.config, ctx_len))
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    model.train()
    for _ in range(ws.steps):
        idx = torch.randint(len(task), (ws.batch_size,), generator=gen).tolist()
        ids = torch.zeros(ws.batch_size, ctx_len, dtype=torch.long)  # [B, L]
        labels = torch.full((ws.batch_size, ctx_len), -100)  # [B, L]
        for row, i in enumerate(idx):
            p = task[i]
            prompt = encode(tokenizer, p.prompt)
            full = (
                prompt + tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            )
            ids[row, : len(full)] = torch.tensor(full)
            labels[row, len(prompt) - 1 : len(full) - 1] = torch.tensor(full[len(prompt) :])
        logits = forward(model, ids.to(device), DEFAULT_OPS, ctx_len, rope)  # [B, L, V]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(device),
            label_smoothing=ws.label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval().to("cpu")


def build_and_cache(
    path: Path,
    model_cfg: ModelConfig,
    ws: WarmstartConfig,
    tokenizer,
    task,
    ctx_len: int,
    device: str = "cpu",
) -> torch.nn.Module:
    """The warm start built now (the SFT on `device`, drawing nothing from the caller's RNG), saved to `path`
    (save_pretrained, float32: what a later load reads gives these bits); -> the model."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(model_cfg, seed=ws.seed)
        sft(model, tokenizer, task, ws, ctx_len, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent builder's identical result wins, ours is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


def is_cached(path: Path) -> bool:
    """Whether `path` (a `warmstart_dir`) holds a built warm start."""
    return (path / "config.json").is_file()


def load_or_build(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    ws: WarmstartConfig,
    tokenizer,
    task,
    ctx_len: int,
    device: str = "cpu",
) -> torch.nn.Module:
    """The cached warm start, or one built now (the SFT on `device`, then cached)."""
    path = warmstart_dir(model_cfg, data_cfg, ws, tokenizer, device)
    if is_cached(path):
        return build_model(dataclasses.replace(model_cfg, path=str(path)), seed=ws.seed)
    return build_and_cache(path, model_cfg, ws, tokenizer, task, ctx_len, device)
