"""The one place that decides what `determinism=on` / `off` means. Everything else asks it.

| source              | off (torch defaults, as real systems run)  | on                                           |
|---------------------|--------------------------------------------|----------------------------------------------|
| sampling RNG        | each worker's stream, in the order its     | per-sample seed = hash(seed, step, uid, idx) |
|                     | batches run                                |                                              |
| result order        | completion order                           | submission order (data position, sample idx) |
| routing to workers  | first free worker, dynamic batches         | submission order in full batches, batch j -> |
|                     |                                            | worker j mod num_workers                     |
| kernels             | F.linear / SDPA / F.silu / grouped MoE     | batch-invariant ops (detrl.models.ops)       |
| MoE routing         | torch.topk (ties as the kernel breaks them)| stable sort: ties -> lowest expert id        |
| MoE dispatch        | gather per expert, index_add_ in ascending | the same grouping on batch-invariant gemms,  |
|                     | id, default gemms                          | so a token's result ignores its expert-mates |
| torch               | defaults                                   | deterministic algorithms (no NaN-fill of     |
|                     |                                            | torch.empty), CUBLAS workspace, TF32 off     |
| ranks (torchrun)    | prompt groups from a shared queue; each    | groups in contiguous blocks by submission    |
|                     | rank a contiguous 1/W of a mini-batch,     | order; virtual micro-batches k -> rank k % W,|
|                     | gradients all-reduced and averaged         | gradients summed in micro-batch order        |
Both modes seed python, numpy and torch from the run seed: `off` releases pins, it never adds noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import struct
from dataclasses import dataclass

import numpy as np
import torch

from detrl.models.ops import BATCH_INVARIANT_OPS, CUDA_DEFAULT_OPS, CUDA_INVARIANT_OPS, DEFAULT_OPS, Ops
from detrl.rollout.base import Request, Result


def stable_hash(*parts: int | str) -> int:
    """A 63-bit hash of the parts, stable across processes and machines (unlike `hash`)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x00")
    return struct.unpack("<Q", h.digest())[0] >> 1


@dataclass(frozen=True)
class Determinism:
    enabled: bool
    seed: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32  # the compute dtype (master weights stay float32)
    activation_checkpointing: bool = False

    @property
    def ops(self) -> Ops:
        """The op set for this mode and device (CPU, float32, no recomputation: the CPU sets themselves);
        on CUDA with determinism on, the Triton batch-invariant kernels (detrl.models.triton_ops)."""
        cuda = self.device.type == "cuda"
        if self.enabled:
            base = CUDA_INVARIANT_OPS if cuda else BATCH_INVARIANT_OPS
        else:
            base = CUDA_DEFAULT_OPS if cuda else DEFAULT_OPS
        if self.dtype == torch.float32 and not self.activation_checkpointing:
            return base
        return dataclasses.replace(base, dtype=self.dtype, checkpoint=self.activation_checkpointing)

    def prompt_uid(self, data_position: int) -> int:
        """Stable id of the prompt at a data position (the same in both modes: ids are ids)."""
        return stable_hash("prompt", self.seed, data_position)

    def sampling_seed(self, step: int, prompt_uid: int, sample_index: int) -> int | None:
        """Per-sample seed when on; None (the engine's streams) when off."""
        if not self.enabled:
            return None
        return stable_hash("sample", self.seed, step, prompt_uid, sample_index)

    @property
    def fixed_routing(self) -> bool:
        """on: full batches in submission order, batch j -> worker j mod W; off: first free worker."""
        return self.enabled

    def rank_split(self, groups: int, world: int) -> list[int] | None:
        """Which rank generates each of `groups` prompt groups (submission order) under torchrun. on: a fixed
        rule, contiguous near-equal blocks in submission order (group i -> rank i * W // G), so a group's
        rank depends on nothing that runs; with per-sample seeds and batch-invariant ops its bits do not
        depend on the rank at all. off: None, by availability (ranks claim chunks from a shared queue)."""
        if not self.enabled:
            return None
        return [i * world // groups for i in range(groups)]

    def order(self, results: list[Result], requests: list[Request]) -> list[Result]:
        """on: submission order (data position, then sample index); off: as the engine returned them."""
        if not self.enabled:
            return list(results)
        rank = {r.uid: i for i, r in enumerate(requests)}
        return sorted(results, key=lambda r: rank[r.uid])


def setup(enabled: bool, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          activation_checkpointing: bool = False) -> Determinism:
    """Seed every RNG from the run seed (CUDA's too: torch.manual_seed seeds every device) and set torch's
    global determinism flags, before any CUDA work (cuBLAS reads its workspace config at first use)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if enabled:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(enabled)
    # ...but without NaN-filling every torch.empty (a guard for kernels that read memory they never wrote:
    # none here, and the bitwise tests would see it): measured ~20% of a CPU decode step on the tiny model
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
    torch.backends.cuda.matmul.allow_tf32 = not enabled
    torch.backends.cudnn.allow_tf32 = not enabled
    return Determinism(enabled=enabled, seed=seed, device=torch.device(device), dtype=dtype,
                       activation_checkpointing=activation_checkpointing)
