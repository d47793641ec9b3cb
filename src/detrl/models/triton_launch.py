"""What every batch-invariant Triton kernel's launch shares: the pinned compiler flags, the device's SM count and
the backward as a torch recomputation."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Triton's default for fusing a*b+c into one FMA changes in 3.10; fusion changes the bits, so every launch pins it
# (the value the kernels were measured with on the H200, Triton 3.6). Recorded in numerics.json.
FP_FUSION = True
LAUNCH = {"enable_fp_fusion": FP_FUSION}

_SMS: dict[int, int] = {}


def sms(device: torch.device) -> int:
    """The device's SM count (the interpreter on CPU, as the tests run it: an H200's 132)."""
    if device.type != "cuda":
        return 132
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def recompute(fn: Callable, dy: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A kernel's backward: the gradients of its torch recomputation fn(*inputs) w.r.t. inputs, for the upstream
    gradient dy (torch's own backwards, deterministic run to run; their bits need not match the forward's)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, dy)
