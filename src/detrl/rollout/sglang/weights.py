"""Weights on disk, both sides of /update_weights_from_disk: the client writes them, the stand-in loads them.

Paths below are relative to `sglang/srt/` of SGLang 0.5.23.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("detrl.serve")

# models/qwen3.py Qwen3ForCausalLM.load_weights `stacked_params_mapping`: these shard names load into one
# fused parameter (qkv_proj, gate_up_proj); a name carrying one that the model lacks indexes params_dict -> KeyError
_SHARDS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def save_weights(state_dict: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write `state_dict` as `directory/model.safetensors`, the way SGLang's loader reads it.

    Tied tensors (Qwen3-0.6B..4B: lm_head.weight is model.embed_tokens.weight) are written once, under the
    first name in state_dict order, as transformers' save_pretrained does: safetensors refuses shared storage,
    and its save_model would keep the alphabetically first name, lm_head.weight, which SGLang's tied Qwen3 skips
    (models/qwen3.py `load_weights`), leaving the embeddings stale. Written to a side file and renamed.
    """
    from safetensors.torch import save_file

    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            continue  # an alias of an earlier name
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    tmp = directory / "model.safetensors.partial"  # not *.safetensors: the loader globs those
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / "model.safetensors")
    return directory / "model.safetensors"


def _target(name: str, params: dict[str, torch.Tensor]) -> str | None:
    """The parameter `name` loads into, as Qwen3's load_weights resolves it; None: skipped (with a warning)."""
    if not name.startswith("model.") and name.startswith(("layers.", "embed_tokens.", "norm.")):
        name = "model." + name
    if "rotary_emb.inv_freq" in name or "projector" in name or "rotary_emb.cos_cached" in name:
        return None
    if "rotary_emb.sin_cached" in name or (name.endswith(".bias") and name not in params):
        return None
    shard = next((s for s in _SHARDS if s in name), None)
    if shard is not None and name not in params:
        raise KeyError(name.replace(shard, _SHARDS[shard]))  # params_dict[name] of the fused name
    if name not in params:
        log.warning("Parameter %s not found in params_dict", name)
        return None
    return name


def load_weights_from_disk(model: torch.nn.Module, model_path: str) -> None:
    """Load every *.safetensors of `model_path` into `model` by name, as SGLang's update does, or change nothing.

    model_executor/model_runner_components/weight_updater.py `update_weights_from_disk` -> model_loader/loader.py
    `DefaultModelLoader._prepare_weights` (a local dir: "*.safetensors"; none -> "Cannot find any model weights
    with `<path>`") -> models/qwen3.py `load_weights`: an unknown name is skipped with a warning, a shard name
    (q_proj, ..., up_proj) without its parameter raises KeyError, a shape mismatch fails default_weight_loader's
    assert, a name not in the files keeps its old value; with tie_word_embeddings "model.embed_tokens.weight"
    loads both. On failure SGLang rolls back and reports "Failed to update weights: ..."; here every tensor is
    checked before any is copied, so the old weights stay. Raises ValueError with SGLang's message.
    """
    from safetensors.torch import load_file

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ValueError(
            f"Failed to get weights iterator: Cannot find any model weights with `{model_path}`."
        )
    params = dict(model.named_parameters())  # a tied storage once, under model.embed_tokens.weight
    staged: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            for name, w in load_file(str(f)).items():
                target = _target(name, params)
                if target is None:
                    continue
                if w.shape != params[target].shape:  # model_loader/weight_utils.py default_weight_loader
                    raise AssertionError(
                        f"Attempted to load weight ({w.size()}) into parameter ({params[target].size()})"
                    )
                staged[target] = w
    except Exception as e:  # noqa: BLE001 - SGLang reports any failure of the load
        raise ValueError(f"Failed to update weights: {e}.\nRolling back to original weights.") from e
    with torch.no_grad():
        for name, w in staged.items():
            params[name].copy_(w)  # copy_ casts to the served dtype, as weight_loader does
