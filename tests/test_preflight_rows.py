"""The CUDA preflight's row spread covers both launch paths of the invariant gemm on the real model shapes:
the small calls of the spread launch split-K, the reference call launches every shape unsplit with the
training-size tiles (as training batches do). Pure launch arithmetic: runs on CPU (triton imports without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

triton_ops = pytest.importorskip("detrl.models.triton_ops")
from detrl.models.preflight import REFERENCE_ROWS, ROWS  # noqa: E402

PRESETS = ("qwen3_0p6b", "qwen3_1p7b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_moe_a3b_6l")


def _gemm_shapes(name: str) -> dict[str, tuple[int, int]]:
    c = OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / f"{name}.yaml")
    h, d = c.hidden_size, c.head_dim
    shapes = {
        "q/k/v": (h, (c.num_attention_heads + 2 * c.num_key_value_heads) * d),
        "o": (c.num_attention_heads * d, h),
        "lm_head": (h, c.vocab_size),
    }
    if c.get("num_experts"):
        shapes["router"] = (h, c.num_experts)
    else:
        shapes |= {"gate/up": (h, 2 * c.intermediate_size), "down": (c.intermediate_size, h)}
    return shapes


@pytest.mark.parametrize("preset", PRESETS)
def test_reference_call_is_unsplit_and_spread_reaches_split_k(preset):
    ref = REFERENCE_ROWS["cuda"]
    assert max(ROWS["cuda"]) + 7 <= ref
    split_at_decode = []
    for what, (k, n) in _gemm_shapes(preset).items():
        assert not triton_ops.splits(ref, k, n), (
            f"{preset} {what} (K={k}, N={n}): the reference call splits K"
        )
        if triton_ops.splits(1, k, n):
            split_at_decode.append(what)
    # the narrow decode gemms (o, down, router, ...) take split-K at one row: the spread compares them to unsplit
    assert len(split_at_decode) >= 2, split_at_decode


def test_spread_covers_the_decode_buckets_above_300():
    spread = set(ROWS["cuda"])
    for bucket in (512, 1024):
        assert {bucket - 1, bucket, bucket + 1} <= spread
