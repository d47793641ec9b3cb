"""The paged attention kernel under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, as in
tests/test_triton_interpret.py): bitwise the contiguous kernel's rows on the gathered keys, in float32 and
float16, for several block sizes and scattered block tables, decode steps and chunked prefills alike."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_helpers import run_script

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from detrl.models.triton_attention import attention
    from detrl.models.triton_paged import PagedMeta, paged_attention

    import sys
    dev, dts = sys.argv[1], [getattr(torch, n) for n in sys.argv[2].split(",")]
    g = torch.Generator().manual_seed(0)
    out = {}
    B, H, HKV, L, D = 2, 4, 2, 70, 64  # 70 keys: two key tiles of 64, the second ragged
    pos = torch.arange(L)
    causal = (pos[None, :] <= pos[:, None])[None, None].to(dev)  # the kernel reads the mask on the device
    for dt in dts:
        q = torch.randn(B, H, L, D, generator=g).to(dev, dt)
        k, v = (torch.randn(B, HKV, L, D, generator=g).to(dev, dt) for _ in range(2))
        train = attention(q, k, v, causal, 0.125)  # the contiguous kernel: the trainer's rows
        for bs in (8, 16, 64):
            width = -(-L // bs)
            blocks = 3 * B * width  # a pool with room to scatter; block `blocks` is the zero block
            perm = torch.randperm(blocks, generator=g)[: B * width].view(B, width)
            size = (blocks + 1) * bs
            kp, vp = (torch.randn(HKV * size, D, generator=g).to(dev, dt) for _ in range(2))  # stale slots: noise
            for b in range(B):
                slots = (perm[b, :, None] * bs + torch.arange(bs)).flatten()[:L].to(dev)
                for hh in range(HKV):
                    kp[hh * size + slots] = k[b, hh]
                    vp[hh * size + slots] = v[b, hh]
            def run(qq, positions):
                meta = PagedMeta(perm.to(dev), positions.to(dev), size, bs, L)
                return paged_attention(qq, kp, vp, meta, 0.125)
            key = f"{str(dt)[6:]}_bs{bs}"
            out[key + "_decode"] = [torch.equal(run(q[:, :, p : p + 1], torch.full((B, 1), p))[:, :, 0],
                                                train[:, :, p]) for p in (0, 5, 63, 64, 69)]
            # chunks starting mid-sequence (ragged and across the key tile edge), and a whole prefill
            out[key + "_chunks"] = [torch.equal(run(q[:, :, a:z], torch.arange(a, z).expand(B, -1)),
                                                train[:, :, a:z]) for a, z in ((0, 9), (13, 29), (60, 70), (0, 70))]
            # rows of one batch at different positions (a decode batch: sequences of different lengths)
            mixed = torch.tensor([[7], [66]], device=dev)
            qm = torch.stack([q[0, :, 7:8], q[1, :, 66:67]])
            got = run(qm, mixed)
            out[key + "_mixed"] = torch.equal(got[0, :, 0], train[0, :, 7]) and torch.equal(got[1, :, 0], train[1, :, 66])
    print("RESULT" + json.dumps(out))
    """
)


def _script(device: str, dtypes: str, interpret: bool) -> dict:
    return run_script(SCRIPT, device, dtypes, interpret=interpret)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _script("cpu", "float32,float16", interpret=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_paged_rows_are_the_contiguous_kernels_rows(interpreted, dtype, block_size):
    """Decode rows at positions 0, 5, 63, 64, 69; chunks [0, 9), [13, 29), [60, 70), [0, 70); a batch of two
    sequences at different positions: each through a scattered block table over a pool whose other slots
    hold noise, bitwise the contiguous kernel's causal pass."""
    key = f"{dtype}_bs{block_size}"
    assert all(interpreted[key + "_decode"]), interpreted[key + "_decode"]
    assert all(interpreted[key + "_chunks"]), interpreted[key + "_chunks"]
    assert interpreted[key + "_mixed"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_paged_rows_are_the_contiguous_kernels_bits_in_bfloat16():
    """The same checks compiled for the device, in bfloat16 and float32 (the H200's tensor-core dots)."""
    out = _script("cuda", "bfloat16,float32", interpret=False)
    assert len(out) == 18
    bad = [k for k, v in out.items() if not (all(v) if isinstance(v, list) else v)]
    assert not bad, bad
