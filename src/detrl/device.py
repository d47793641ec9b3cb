"""Where a run computes, decided once: `device=auto|cpu|cuda` and `model.dtype=auto|float32|bfloat16`.

auto: CUDA when torch sees a GPU, else CPU. The compute dtype `auto` is float32 on CPU (the CPU default's
bits never change) and bfloat16 on CUDA. Master weights and optimizer state stay float32 on every device:
the forward runs on bf16 copies of the fused weights (`detrl.models.forward.fuse(model, dtype)`), whose
gradients flow back to the float32 parameters.
"""

from __future__ import annotations

import dataclasses

import torch

from detrl.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' is not valid here: torch sees no CUDA device (use device=cpu or auto)"
        )
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r} is not valid; choose one of ['auto', 'cpu', 'cuda']")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype: auto = float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not valid; choose one of ['auto', *{list(DTYPES)}]")
    return DTYPES[name]


def to_device(batch, device: torch.device):
    """A dataclass of tensors (a StepBatch) with every tensor field on `device` (the same object on its own)."""
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).device != device
    }
    return dataclasses.replace(batch, **moved) if moved else batch
