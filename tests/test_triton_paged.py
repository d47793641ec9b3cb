"""The paged attention kernel under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess): bitwise the
contiguous invariant kernel's rows on the gathered keys, for several block sizes and block layouts, in float32
and float16 (the interpreter has no bfloat16), for decode, prefill from position 0 and chunked prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from detrl.models.triton_attention import attention
    from detrl.models.triton_paged import PagedKeys, paged_attention

    out = {}
    B, H, HKV, L, D = 2, 4, 2, 70, 64  # 70 keys: two key blocks of 64, the second ragged
    for dt in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, L, D, generator=g).to(dt)
        k, v = (torch.randn(B, HKV, L, D, generator=g).to(dt) for _ in range(2))
        pos = torch.arange(L)
        causal = (pos[None, :] <= pos[:, None])[None, None]
        train = attention(q, k, v, causal, 0.125)  # the contiguous kernel: every row at its position
        for bs, order in ((4, "shuffled"), (8, "reversed"), (16, "shuffled"), (64, "in order")):
            width = -(-L // bs)
            blocks = B * width + 3  # a few blocks no row uses
            ids = torch.arange(blocks)
            ids = {"in order": ids, "reversed": ids.flip(0), "shuffled": torch.randperm(blocks, generator=g)}[order]
            tables = ids[: B * width].view(B, width)
            size = (blocks + 1) * bs
            slots = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :L]  # [B, L]
            kp = torch.randn(HKV * size, D, generator=g).to(dt)  # junk in the unused slots
            vp = torch.randn(HKV * size, D, generator=g).to(dt)
            heads = (torch.arange(HKV) * size)[None, :, None]
            kp[(slots[:, None, :] + heads).flatten()] = k.reshape(-1, D)
            vp[(slots[:, None, :] + heads).flatten()] = v.reshape(-1, D)
            name = f"{str(dt)[6:]}/bs{bs}/{order}"
            def run(p0, t):
                positions = (p0 + torch.arange(t))[None].expand(B, t)
                keys = PagedKeys(positions, slots, size)
                return paged_attention(q[:, :, p0 : p0 + t], kp, vp, keys, 0.125)
            out[name] = {
                "prefill": torch.equal(run(0, L), train),
                "chunk": [torch.equal(run(p0, t), train[:, :, p0 : p0 + t]) for p0, t in ((8, 8), (60, 10), (33, 1))],
                "decode": [torch.equal(run(p, 1), train[:, :, p : p + 1]) for p in (0, 5, 63, 64, 69)],
            }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_paged_rows_are_the_contiguous_kernels_bits_for_every_block_layout(interpreted):
    assert len(interpreted) == 8  # 2 dtypes x 4 layouts
    for name, r in interpreted.items():
        assert r["prefill"], name
        assert all(r["chunk"]), (name, r["chunk"])
        assert all(r["decode"]), (name, r["decode"])
