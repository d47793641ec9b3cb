"""The CUDA batch-invariant Triton kernels, run on CPU by Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess: the variable must be set before the kernels are decorated).

The interpreter computes in numpy, which has no bfloat16 (its bf16 dots are garbage), so these run in float16:
they check the kernels' structure (the K chunking, split-K's ordered sum, masks at ragged edges, the fused
epilogues, the grouped gemm's tile map, attention's key blocks), not the H200's bits, which `tests/test_gpu.py -m gpu` and the run's preflight check on the device.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_helpers import run_script

SCRIPT = textwrap.dedent(
    """
    import json, torch
    import torch.nn.functional as F
    from detrl.models import triton_ops as T
    from detrl.models.ops import moe_dispatch, sdpa_attention
    from detrl.models.primitives import apply_rope as rope, rms_norm

    g = torch.Generator().manual_seed(0)
    dt = torch.float16
    out = {}
    # K = 1100: chunks of 512, 512 and a ragged 76; N = 96: a ragged N tile of 64
    a = torch.randn(70, 1100, generator=g).to(dt)
    w = (torch.randn(96, 1100, generator=g) / 30).to(dt)
    r = torch.randn(70, 96, generator=g).to(dt)
    ref = T.gemm(a, w, split=False)
    out["chunks"] = T.chunk_k(1100)
    out["close_to_fp32"] = float((ref.float() - a.float() @ w.float().T).abs().max())
    out["split_eq_unsplit"] = torch.equal(T.gemm(a, w, split=True), ref)
    tiles = [T.FIXED, T.Tiles(16, 32, 64, 4, 4), T.Tiles(128, 128, 64, 8, 3), T.Tiles(64, 32, 64, 4, 4),
             T.Tiles(128, 256, 64, 8, 3)]
    out["tiles_eq"] = [torch.equal(T.gemm(a, w, tiles=t, split=s), ref) for t in tiles for s in (False, True)]
    out["rows_eq"] = [torch.equal(T.gemm(a[i : i + m], w, split=s), ref[i : i + m])
                      for i, m in ((0, 1), (5, 1), (69, 1), (3, 7), (10, 33)) for s in (False, True)]
    plain = (r.float() + ref.float()).to(dt)
    out["residual_eq"] = [torch.equal(T.gemm(a, w, residual=r, split=s), plain) for s in (False, True)]
    out["linear_add_eq"] = torch.equal(T.linear_add(a[None], w, r[None])[0], plain)
    x = torch.randn(3, 5, 2 * 200, generator=g).to(dt)
    gate, up = x.chunk(2, -1)
    out["silu_mul_eq"] = torch.equal(T.silu_mul(x), F.silu(gate) * up)
    q = torch.randn(2, 5, 6, 64, generator=g).to(dt)
    nw = torch.randn(6, 64, generator=g).to(dt)
    cos, sin = torch.randn(2, 2, 5, 1, 64, generator=g).to(dt)
    out["norm_rope_eq"] = torch.equal(T.norm_rope(q, nw, 1e-6, cos, sin), rope(rms_norm(q, nw, 1e-6), cos, sin))
    # the q/k heads as the forward passes them: a strided view of the qkv output
    qkv = torch.randn(2, 5, 10, 64, generator=g).to(dt)
    out["norm_rope_view_eq"] = torch.equal(T.norm_rope(qkv[:, :, :6], nw, 1e-6, cos, sin),
                                           rope(rms_norm(qkv[:, :, :6], nw, 1e-6), cos, sin))
    # the MoE's grouped gemm on a tile map: each expert's rows get the plain gemm's bits (K = 128: one chunk)
    xe = torch.randn(40, 128, generator=g).to(dt)
    we = (torch.randn(3, 96, 128, generator=g) / 10).to(dt)
    grouped = T.grouped_gemm(xe, we, T.tile_map(torch.tensor([7, 0, 33]), 40))
    out["grouped_eq"] = [torch.equal(grouped[a:b], T.gemm(xe[a:b], we[e], split=False))
                         for e, a, b in ((0, 0, 7), (2, 7, 40))]
    top_w, top_i = torch.rand(10, 2, generator=g).to(dt), torch.stack([torch.randperm(4, generator=g)[:2]
                                                                        for _ in range(10)])
    xm = torch.randn(10, 64, generator=g).to(dt)
    gu, dn = (torch.randn(4, 64, 64, generator=g) / 8).to(dt), (torch.randn(4, 64, 32, generator=g) / 6).to(dt)
    ref = moe_dispatch(xm.float(), top_w.float(), top_i, gu.float(), dn.float(), F.linear, F.silu)
    out["moe_err"] = float((T.moe(xm, top_w, top_i, gu, dn, None, None).float() - ref).abs().max())
    xn, wn = torch.randn(6, 200, generator=g).to(dt), torch.randn(200, generator=g).to(dt)
    out["rms_err"] = float((T.rms_norm(xn, wn, 1e-6).float() - rms_norm(xn.float(), wn.float(), 1e-6)).abs().max())
    # attention: 2 query heads per kv head, 70 keys (two key blocks of 64), head dim 64
    q = torch.randn(2, 4, 70, 64, generator=g).to(dt)
    k, v = (torch.randn(2, 2, 70, 64, generator=g).to(dt) for _ in range(2))
    pos = torch.arange(70)
    causal = (pos[None, :] <= pos[:, None])[None, None]
    train = T.attention(q, k, v, causal, 0.125)
    exact = sdpa_attention(q.float(), k.float(), v.float(), causal, 0.125)
    out["attn_err"] = float((train.float() - exact).abs().max())
    out["decode_eq"] = [torch.equal(T.attention(q[:, :, p : p + 1], k, v, pos <= torch.full((2, 1, 1, 1), p), 0.125)[:, :, 0],
                                    train[:, :, p]) for p in (0, 5, 63, 64, 69)]
    out["prefill_eq"] = torch.equal(T.attention(q[:, :, :37], k, v, causal[:, :, :37], 0.125), train[:, :, :37])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_script(SCRIPT, timeout=300)


def test_the_gemm_sums_k_in_fixed_chunks_close_to_float32(interpreted):
    assert interpreted["chunks"] == 512
    assert interpreted["close_to_fp32"] < 0.05  # float16 output of a K=1100 dot with |values| ~ 1


def test_split_k_gives_the_unsplit_kernels_bits(interpreted):
    assert interpreted["split_eq_unsplit"]


def test_every_tiling_and_every_row_count_gives_the_same_bits(interpreted):
    """The M and N tiles (what `tiles_for` varies with M) are free: each output's sum runs over K in the same
    BLOCK_K steps inside the same chunks. (On the H200 BLOCK_K 32 and 128 gave the same bits too, call F: the MMA
    accumulates k16 steps in order whatever BLOCK_K is; numpy's dot per BLOCK_K step is not that, so the
    interpreter cannot check it and `tiles_for` keeps BLOCK_K 64.)"""
    assert all(interpreted["tiles_eq"]), interpreted["tiles_eq"]
    assert all(interpreted["rows_eq"]), interpreted["rows_eq"]


def test_the_fused_residual_is_the_eager_sum_of_the_rounded_gemm(interpreted):
    assert all(interpreted["residual_eq"]) and interpreted["linear_add_eq"]


def test_fused_silu_mul_and_norm_rope_compute_what_the_eager_ops_do(interpreted):
    """Bitwise under the interpreter in float16 (numpy's exp and division); on the GPU Triton's fast exp and
    division may round some elements otherwise, which only needs the engine and trainer to share the op set."""
    assert interpreted["silu_mul_eq"]
    assert interpreted["norm_rope_eq"] and interpreted["norm_rope_view_eq"]


def test_the_grouped_gemm_gives_each_expert_the_plain_gemms_bits_and_the_moe_is_close(interpreted):
    """The tile map's rows of each expert (7 rows, an empty expert, 33 rows) against gemm on those rows alone;
    the MoE block (two grouped gemms, silu_mul, the fp32 slot sum) against the eager dispatch in float32."""
    assert all(interpreted["grouped_eq"]), interpreted["grouped_eq"]
    assert interpreted["moe_err"] < 0.02


def test_rms_norm_is_close_to_the_eager_norm(interpreted):
    assert interpreted["rms_err"] < 0.02  # float16 outputs up to ~10: a few ulps


def test_attention_decode_and_prefill_rows_are_the_training_rows(interpreted):
    """A decode row at positions 0, 5, 63, 64 and 69 over the 70-key cache, and a 37-token prefill, give the causal
    training pass's rows bit for bit (a row stops after its own key block; later blocks would be fully masked)."""
    assert interpreted["attn_err"] < 0.005
    assert all(interpreted["decode_eq"]), interpreted["decode_eq"]
    assert interpreted["prefill_eq"]


DOT_SCRIPT = textwrap.dedent(
    """
    import json, torch, triton, triton.language as tl

    @triton.jit
    def dot_tile(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        x = tl.load(a + m[:, None] * K + k[None, :])
        y = tl.load(b + k[:, None] * N + n[None, :])
        tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y, out_dtype=tl.float32))

    def dot(x, y):
        out = torch.empty(x.shape[0], y.shape[1])
        dot_tile[(1,)](x, y, out, x.shape[0], x.shape[1], y.shape[1])
        return out

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=g).half(), torch.randn(32, 16, generator=g).half()
    ref = dot(x, y)
    out = {
        "rows": [torch.equal(dot(x.roll(i, 0), y).roll(-i, 0), ref) for i in range(16)],
        "cols": [torch.equal(dot(x, y.roll(j, 1)).roll(-j, 1), ref) for j in range(16)],
        "err": float((ref - x.float() @ y.float()).abs().max()),
        "halves_eq": torch.equal(dot(x[:, :16], y[:16]) + dot(x[:, 16:], y[16:]), ref),
    }
    print("RESULT" + json.dumps(out))
    """
)


def test_the_interpreters_dot_gives_an_output_the_bits_of_its_row_and_column_alone():
    """`triton_helpers.TILE_DOT`, the interpreter's tl.dot in every script here: an output's bits do not move with
    its row's or column's place in the tile (as a GPU MMA's), it is float32 close to the exact product, and it still
    tells K-orders apart: two K halves summed give other bits than one dot over K (what a BLOCK_K change does)."""
    got = run_script(DOT_SCRIPT, timeout=120)
    assert all(got["rows"]) and all(got["cols"]), got
    assert got["err"] < 1e-4
    assert not got["halves_eq"]
