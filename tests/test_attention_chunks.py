"""Long training passes' attention in recomputed query pieces: the same forward bits, memory bounded in the backward."""

import pytest
import torch

from detrl.models.ops import bi_attention_rows, query_chunked


def _qkv(b=2, h=4, hkv=2, t=80, length=96, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g) for s in ((b, h, t, d), (b, hkv, length, d), (b, hkv, length, d)))
    mask = torch.arange(length)[None, None, None, :] <= torch.arange(t)[None, None, :, None]  # [1, 1, T, L]
    return q, k, v, mask.expand(b, 1, t, length)


def _largest_saved(fn, *inputs) -> int:
    """The largest tensor autograd saves for the backward of fn(*inputs), in elements."""
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*inputs)
    return out, max(sizes)


@pytest.mark.parametrize("chunk", [16, 17, 33])
def test_pieces_give_the_same_forward_bits(chunk):
    q, k, v, mask = _qkv()
    with torch.no_grad():
        whole = bi_attention_rows(q, k, v, mask, 0.25)
    pieces = query_chunked(bi_attention_rows, q, k, v, mask, 0.25, chunk=chunk)
    assert torch.equal(pieces, whole)


def test_pieces_bound_the_backward_and_give_the_gradients():
    q, k, v, mask = _qkv()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    whole, big = _largest_saved(bi_attention_rows, *leaves, mask, 0.25)
    grads = torch.autograd.grad(whole.square().sum(), leaves)
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v)]
    pieces, small = _largest_saved(
        lambda *a: query_chunked(bi_attention_rows, *a, chunk=16), *leaves2, mask, 0.25
    )
    grads2 = torch.autograd.grad(pieces.square().sum(), leaves2)
    b, h, t, _ = q.shape
    length = k.shape[2]
    assert big >= b * h * t * length  # the whole pass saves [B, H, T, L] scores
    assert small < b * h * t * length // 2  # the pieces save their inputs only (recomputed in the backward)
    for g1, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-5)


def test_the_cuda_backward_in_pieces_matches_one_recomputation():
    triton_attention = pytest.importorskip("detrl.models.triton_attention")
    q, k, v, mask = _qkv(t=96)
    do = torch.randn_like(q)
    one = triton_attention.attention_backward(q, k, v, mask, 0.25, do, chunk=96)
    pieces = triton_attention.attention_backward(q, k, v, mask, 0.25, do, chunk=32)
    again = triton_attention.attention_backward(q, k, v, mask, 0.25, do, chunk=32)
    for a, b, c in zip(one, pieces, again):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(b, c)  # run to run: the same bits


def test_the_invariant_op_cuts_long_training_passes(monkeypatch):
    from detrl.models import ops, primitives

    monkeypatch.setattr(primitives, "ATTN_QUERY_CHUNK", 16)
    q, k, v, mask = _qkv()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, saved = _largest_saved(ops.bi_attention, *leaves, mask, 0.25)
    with torch.no_grad():
        assert torch.equal(out, ops.bi_attention_rows(q, k, v, mask, 0.25))  # no grad: one call
    b, h, t, _ = q.shape
    assert saved < b * h * t * k.shape[2] // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_long_pass_trains_through_the_pieces():
    """The Triton attention (determinism=on) at 1,100 bf16 query rows: its backward runs in pieces of 1,024
    (close to one recomputation, the same bits run to run) and holds no [B, H, T, L] probabilities."""
    from detrl.models import triton_attention as ta

    q, k, v, mask = (x.cuda() for x in _qkv(b=2, h=8, hkv=2, t=1100, length=1100, d=64))
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    do = torch.randn_like(q)

    def peak(chunk):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = ta.attention_backward(q, k, v, mask, 0.125, do, chunk=chunk)
        return grads, torch.cuda.max_memory_allocated() - base

    pieces, _ = peak(ta.ATTN_QUERY_CHUNK)
    again, _ = peak(ta.ATTN_QUERY_CHUNK)
    one, whole = peak(1100)
    _, quarter = peak(275)
    for a, b, c in zip(one, pieces, again):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(b, c)
    assert quarter < 0.5 * whole  # the backward's memory follows the piece, not T
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ta.attention(*leaves, mask, 0.125).backward(do)  # the autograd path runs it
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [64, 576])
def test_every_admitted_decode_width_gives_the_full_lengths_bits(threads, length):
    """A decode step cut to an admitted width w (decode_attention.decode_widths) equals the full-length call bitwise on fresh
    data at the engine's shapes: 16 rows, 2 kv heads of 2 query heads each, every row's last attended key at or
    below w (w itself among them), other values in the masked tail."""
    from detrl.models import decode_attention as da

    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        widths = da.decode_widths(32, length, torch.float32)
        assert widths[-1] == length and len(widths) > 1 and all(w % da.ROW_TILE == 0 for w in widths)
        g = torch.Generator().manual_seed(length + threads)
        q = torch.randn(16, 2, 2, 32, generator=g)
        k, v = (torch.randn(16, 2, length, 32, generator=g) for _ in range(2))
        for w in widths:
            live = torch.randint(1, w + 1, (16,), generator=g)
            live[3] = w
            mask = (torch.arange(length) < live[:, None]).view(16, 1, 1, length)
            full = da.decode_rows(q, k, v, mask, 0.17)
            assert da.decode_width(32, length, torch.float32, "cpu", int(live.max())) == w
            assert torch.equal(da.decode_attention(q, k, v, mask, 0.17), full), w
    finally:
        torch.set_num_threads(n)


def test_the_width_probe_rejects_a_width_whose_call_differs():
    """The probe compares real calls: a tail value the full call reads (a NaN the mask does not zero) is caught."""
    from detrl.models import decode_attention as da

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 1, 2, 32, generator=g)
    k, v = (torch.randn(4, 1, 64, 32, generator=g) for _ in range(2))
    assert da._width_agrees(q, k, v, 32)
    v[:, :, 40] = float("nan")  # 0 x NaN is NaN in the full call only
    assert not da._width_agrees(q, k, v, 32)


@pytest.mark.parametrize("t", [1, 5])
def test_keys_a_prefix_of_the_masks_length_give_the_bits_of_all_of_them_zero_past_it(t):
    """bi_attention over the first L' keys of the mask's L (what a paged decode step gathers) equals the call over
    all L with zero keys past L', bitwise: a decode step (t=1, cut or padded to its admitted width) and a
    multi-token one (padded to L)."""
    q, k, v, _ = _qkv(b=3, h=4, hkv=2, t=t, length=576, d=32, seed=t)
    positions = torch.arange(200 - t, 200)  # queries at 200 - t .. 199: no row attends past key 199
    mask = (torch.arange(576)[None, :] <= positions[:, None]).expand(3, 1, t, 576)
    k[:, :, 200:], v[:, :, 200:] = 0, 0
    full = bi_attention_rows(q, k, v, mask, 0.17)
    for have in (200, 208, 320, 575):
        assert torch.equal(bi_attention_rows(q, k[:, :, :have], v[:, :, :have], mask, 0.17), full), have
