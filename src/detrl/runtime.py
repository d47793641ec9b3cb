"""Where and how a run computes, decided once in `builder.build`: the device, the compute dtype, the op set,
whether the CUDA engine compiles, the fixed key length. Whoever needs the device reads it here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detrl.determinism import Determinism
from detrl.models.ops import Ops, select_ops


def context_length(task, tokenizer, max_new_tokens: int) -> int:
    """The fixed key length shared by sampler and trainer: longest prompt (train and eval splits) + new tokens,
    rounded up to 8."""
    splits = [task] + ([task.eval_task] if getattr(task, "eval_task", None) is not None else [])
    longest = max(len(ids) for t in splits for ids in t.encode_all(tokenizer))
    return -(-(longest + max_new_tokens) // 8) * 8


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype  # the compute dtype (master weights stay float32)
    ops: Ops
    # torch.compile the CUDA engine's decode step (torch's kernels only: never the invariant ones)
    compile: bool
    ctx_len: int = 0  # the fixed key length shared by sampler and trainer (0: not known yet)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def make(
    det: Determinism,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    ctx_len: int = 0,
) -> Runtime:
    """The runtime of a determinism policy on a device: its op set, and compile on CUDA with torch's kernels."""
    device = torch.device(device)
    ops = select_ops(device.type, det.invariant_kernels, det.stable_routing, dtype, activation_checkpointing)
    cuda = device.type == "cuda"
    return Runtime(device, dtype, ops, compile=cuda and not det.invariant_kernels, ctx_len=ctx_len)


def ops_for(det: Determinism, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Ops:
    """The op set alone (tests, benchmarks and tools that need no other part of a runtime)."""
    return make(det, device, dtype).ops
