"""CUDA's batch-invariant kernels: Triton forwards whose per-row reduction order is fixed by construction, shared
by the CUDA engine (prefill, graph-captured decode) and the trainer. This module is the op set's one import point;
the kernels live in
- `triton_gemm`: the gemm (K in fixed chunks, split-K with an ordered sum, the residual epilogue), its grouped
  form for the MoE, `linear` / `linear_add`;
- `triton_norm`: RMSNorm, and the fused silu(gate) * up and q/k RMSNorm + rope;
- `triton_attention`: one flash-style kernel for training, prefill and decode;
- `triton_moe`: the MoE block as two grouped gemms;
- `triton_launch`: what every launch shares (pinned compiler flags, the SM count, the torch-recomputed backward).
Backwards are deterministic torch recomputations (custom autograd Functions); their bits need not match the
forward's, only repeat run to run. No host syncs anywhere: everything is CUDA-graph capturable.
"""

from __future__ import annotations

from detrl.models.triton_attention import ATTN_BLOCK_M, ATTN_BLOCK_N, attention
from detrl.models.triton_gemm import (
    BLOCK_K,
    BLOCK_M,
    CHUNK_K,
    FIXED,
    Tiles,
    block_n,
    chunk_k,
    gemm,
    grouped_gemm,
    linear,
    linear_add,
    splits,
    tile_map,
    tiles_for,
)
from detrl.models.triton_launch import FP_FUSION, LAUNCH
from detrl.models.triton_moe import moe
from detrl.models.triton_norm import norm_rope, rms_norm, silu_mul

__all__ = [
    "ATTN_BLOCK_M",
    "ATTN_BLOCK_N",
    "BLOCK_K",
    "BLOCK_M",
    "CHUNK_K",
    "FIXED",
    "FP_FUSION",
    "LAUNCH",
    "Tiles",
    "attention",
    "block_n",
    "chunk_k",
    "gemm",
    "grouped_gemm",
    "linear",
    "linear_add",
    "moe",
    "norm_rope",
    "rms_norm",
    "silu_mul",
    "splits",
    "tile_map",
    "tiles_for",
]
