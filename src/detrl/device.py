"""Where a run computes, decided once: `device=auto|cpu|cuda` and `model.dtype=auto|float32|bfloat16|float16`.

auto: CUDA when torch sees a GPU, else CPU. The compute dtype `auto` is float32 on CPU (the CPU default's
bits never change) and bfloat16 on CUDA. Master weights and optimizer state stay float32 on every device:
the forward runs on bf16 copies of the fused weights (`detrl.models.forward.fuse(model, dtype)`), whose
gradients flow back to the float32 parameters. float16 ("Defeating the training-inference mismatch via FP16",
arXiv 2510.26788: 10 mantissa bits to bf16's 7, so trainer and engine round less apart) adds dynamic loss
scaling (`detrl.loss_scale`) for its narrow exponent range.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools

import torch

from detrl.config.base import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def check_compute_dtype(device: torch.device, dtype: torch.dtype, invariant_kernels: bool) -> None:
    """Refuse, in one line, a compute dtype whose bits the batch-invariant kernels cannot promise here."""
    if dtype == torch.float16 and device.type == "cpu" and invariant_kernels:
        # measured: the trainer's float16 logprobs differ from the engine's (~1e-8 mean, step 1), where
        # float32 and bfloat16 are bitwise equal; the gemm preflight passes, so it is another op's float16 kernel
        raise ConfigError(
            "model.dtype=float16 is not valid with determinism.kernels=batch_invariant on CPU: trainer and "
            "engine logprobs are not bitwise equal in float16 here; use determinism=off (or kernels=default), "
            "or model.dtype=bfloat16 / float32"
        )
    if dtype == torch.float32 and device.type == "cuda" and invariant_kernels:
        raise ConfigError(
            "model.dtype=float32 is not valid with determinism.kernels=batch_invariant on CUDA: the "
            "Triton kernels' float32 dots run in TF32; use model.dtype=bfloat16 (or auto)"
        )


def to_device(batch, device: torch.device):
    """A dataclass of tensors (a StepBatch) with every tensor field on `device` (the same object on its own)."""
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).device != device
    }
    return dataclasses.replace(batch, **moved) if moved else batch


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU with its core count."""
    import os

    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def available_bytes(device: torch.device) -> float:
    """Bytes this rank may use: free device memory (CUDA), or available RAM shared by the host's ranks (CPU)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    import os

    import psutil

    return psutil.virtual_memory().available / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None  # glibc only


def trim_host_memory() -> None:
    """Give the host heap's free pages back to the OS (glibc `malloc_trim(0)`; elsewhere a no-op).

    Called by a sharded model's gathers (`fsdp.Gather`, after each block's all-gather and after its backward's
    reduce; `fsdp.full_items` / `full_params` after a pass over the parameters): glibc keeps freed memory (its mmap threshold rises to the largest block freed, up to
    32 MiB, so the gathered blocks come from the heap and stay resident as free holes), and a rank's RSS grew by
    every block it gathered. Measured on `benchmarks/memory.py --ranks 1,2` (50M parameters, 2 CPU cores, with
    other work on the machine): 2-rank peak RSS 1,787 -> 1,391 MiB per rank (1,364 with the parameter passes
    trimmed too); the price is re-faulting those pages:
    +16% CPU time and ~+20% step time on that run (the default model's 2-rank run: no measurable change). One
    process never calls it. Trimming only after each micro-batch and the optimizer step saved less (1,541 MiB);
    only in the backward, less still (1,578); a fixed glibc threshold (MALLOC_MMAP_THRESHOLD_=65536) as much
    as per block but made the one-process default step 2.7x slower."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
