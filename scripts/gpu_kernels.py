"""Issue 16 on a GPU: the Triton batch-invariant kernels against torch, bit for bit where they must agree with
themselves, and timed against torch's kernels on the models' real shapes.

    bash scripts/gpu_run.sh python3 scripts/gpu_kernels.py [--out results.json]

Prints one line per check: max |diff| against torch's kernel (float tolerance), and bitwise results for
rows (a row alone / at another offset vs inside a large call), phases (decode over the cache vs the causal
training pass vs a prefill), backward run to run; then per-shape times (CUDA events, median of 20) of the
Triton gemm vs cuBLAS (F.linear) at decode (64 rows) and training (64 x 272 rows) sizes; and whether cuBLAS
and torch._grouped_mm happen to be row-invariant on these shapes (the negative-control question).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as determinism.setup(): before CUDA starts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from detrl.models import triton_ops as T  # noqa: E402
from detrl.models.ops import grouped_moe, rms_norm, route, sdpa_attention  # noqa: E402

R: dict = {}
BF = torch.bfloat16


def out(key, value):
    R[key] = value
    print(f"{key}: {value}", flush=True)


def ms(fn, n=20) -> float:
    fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rows_invariant(fn, k, total=320) -> str:
    x = torch.randn(total, k, device="cuda", dtype=BF)
    ref = fn(x)
    for m in (*range(1, 18), 31, 33, 64, 65, 128, 129, 256, 257, 300):
        for o in (0, 7):
            if not torch.equal(fn(x[o : o + m]), ref[o : o + m]):
                return f"VARIES at m={m} o={o}"
    big = torch.cat([x, torch.randn(64 * 272 - total, k, device="cuda", dtype=BF)])
    if not torch.equal(fn(big)[:total], ref):
        return "VARIES at m=17408"
    return "invariant"


def gemms():
    shapes = {
        "0.6B qkv": (1024, 4096),
        "0.6B o": (2048, 1024),
        "0.6B gate_up": (1024, 6144),
        "0.6B down": (3072, 1024),
        "0.6B lm_head": (1024, 151936),
        "moe qkv": (2048, 5120),
        "moe o": (4096, 2048),
        "moe router": (2048, 128),
    }
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=BF) * k**-0.5
        x = torch.randn(300, k, device="cuda", dtype=BF)
        d = (T.gemm(x, w).float() - F.linear(x, w).float()).abs().max().item()
        out(f"gemm {name} K={k} N={n}: max|triton - cublas|", d)
        out(f"gemm {name}: triton rows", rows_invariant(lambda a, w=w: T.gemm(a, w), k))
        out(f"gemm {name}: cublas rows", rows_invariant(lambda a, w=w: F.linear(a, w), k))
        for m in (64, 256, 64 * 272):
            a = torch.randn(m, k, device="cuda", dtype=BF)
            if n > 100000 and m > 256:
                continue
            out(
                f"gemm {name} M={m}: ms triton / cublas",
                (round(ms(lambda a=a, w=w: T.gemm(a, w)), 4), round(ms(lambda a=a, w=w: F.linear(a, w)), 4)),
            )


def norms():
    x = torch.randn(64, 272, 1024, device="cuda", dtype=BF)
    w = torch.randn(1024, device="cuda", dtype=BF)
    out(
        "rms max|triton - torch|",
        (T.rms_norm(x, w, 1e-6).float() - rms_norm(x, w, 1e-6).float()).abs().max().item(),
    )
    flat = x.view(-1, 1024)
    out("rms triton rows", rows_invariant(lambda a: T.rms_norm(a, w, 1e-6), 1024))
    out("rms torch rows", rows_invariant(lambda a: rms_norm(a, w, 1e-6), 1024))
    qkv = torch.randn(8, 272, 32, 128, device="cuda", dtype=BF)
    wq = torch.randn(24, 128, device="cuda", dtype=BF)
    out(
        "rms heads slice max|diff|",
        (T.rms_norm(qkv[:, :, :24], wq, 1e-6).float() - rms_norm(qkv[:, :, :24], wq, 1e-6).float())
        .abs()
        .max()
        .item(),
    )
    out(
        "rms M=17408 ms triton / torch",
        (round(ms(lambda: T.rms_norm(flat, w, 1e-6)), 4), round(ms(lambda: rms_norm(flat, w, 1e-6)), 4)),
    )
    lp = torch.randn(300, 151936, device="cuda", dtype=BF)
    f = lambda a: F.log_softmax(a.float(), -1)  # noqa: E731
    ref = f(lp)
    out(
        "log_softmax torch rows",
        all(
            torch.equal(f(lp[o : o + m]), ref[o : o + m]) for m in (1, 2, 5, 16, 17, 64, 100) for o in (0, 7)
        ),
    )


def attention():
    for name, h, hkv in (("0.6B", 16, 8), ("moe", 32, 4)):
        b, length, d = 4, 272, 128
        q = torch.randn(b, h, length, d, device="cuda", dtype=BF)
        k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=BF) for _ in range(2))
        mask = (
            torch.arange(length, device="cuda")[None, None, None, :]
            <= torch.arange(length, device="cuda")[None, None, :, None]
        )
        train = T.attention(q, k, v, mask, d**-0.5)
        ref = sdpa_attention(q, k, v, mask, d**-0.5)
        out(f"attn {name} train max|triton - sdpa|", (train.float() - ref.float()).abs().max().item())
        bad = []
        for p in (0, 1, 5, 63, 64, 65, 127, 200, 271):
            m1 = torch.arange(length, device="cuda")[None, None, None, :] <= torch.full(
                (b, 1, 1, 1), p, device="cuda"
            )
            dec = T.attention(q[:, :, p : p + 1], k, v, m1, d**-0.5)
            if not torch.equal(dec[:, :, 0], train[:, :, p]):
                bad.append(p)
        out(f"attn {name} decode == training row (bitwise), failing positions", bad)
        pre = T.attention(q[:, :, :37], k, v, mask[:, :, :37], d**-0.5)
        out(f"attn {name} prefill(37) == training rows (bitwise)", torch.equal(pre, train[:, :, :37]))
        one = T.attention(q[1:2], k[1:2], v[1:2], mask, d**-0.5)
        out(f"attn {name} batch of 1 == row of batch 4 (bitwise)", torch.equal(one, train[1:2]))
        # backward vs sdpa's, and run to run
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        go = torch.randn_like(q)
        g1 = torch.autograd.grad(T.attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        g2 = torch.autograd.grad(T.attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        gr = torch.autograd.grad(sdpa_attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        out(
            f"attn {name} backward max|triton - sdpa| (q, k, v)",
            [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
        )
        out(f"attn {name} backward run to run bitwise", all(torch.equal(a, b2) for a, b2 in zip(g1, g2)))
        big_q = torch.randn(64, h, length, d, device="cuda", dtype=BF)
        big_k, big_v = (torch.randn(64, hkv, length, d, device="cuda", dtype=BF) for _ in range(2))
        dq = big_q[:, :, :1]
        m1 = torch.arange(length, device="cuda")[None, None, None, :] <= torch.full(
            (64, 1, 1, 1), 200, device="cuda"
        )
        args = (big_q, big_k, big_v)
        out(
            f"attn {name} B=64 train ms triton / sdpa flash",
            (
                round(ms(lambda a=args, m=mask, s=d**-0.5: T.attention(*a, m, s)), 4),
                round(
                    ms(lambda a=args: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True)), 4
                ),
            ),
        )
        out(
            f"attn {name} B=64 decode ms triton",
            round(ms(lambda a=(dq, big_k, big_v, m1), s=d**-0.5: T.attention(*a, s)), 4),
        )


def moe():
    n, e, hdim, inter, k = 300, 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hdim, device="cuda", dtype=BF, generator=g)
    gu = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=BF, generator=g) * hdim**-0.5
    dn = torch.randn(e, hdim, inter, device="cuda", dtype=BF, generator=g) * inter**-0.5
    router = torch.randn(e, hdim, device="cuda", dtype=BF, generator=g) * hdim**-0.5

    def run(fn, a):
        tw, ti = route(T.linear(a, router), k, True)
        return fn(a, tw, ti, gu, dn, None, F.silu)

    ref = run(grouped_moe, x)
    mine = run(T.moe, x)
    out("moe max|triton - grouped_mm|", (mine.float() - ref.float()).abs().max().item())
    out("moe triton rows", rows_invariant(lambda a: run(T.moe, a), hdim))
    out("moe grouped_mm rows", rows_invariant(lambda a: run(grouped_moe, a), hdim))
    xs = x.detach().clone().requires_grad_()
    gus, dns = gu.clone().requires_grad_(), dn.clone().requires_grad_()
    go = torch.randn_like(x)
    tw, ti = route(T.linear(x, router), k, True)
    g1 = torch.autograd.grad(T.moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    g2 = torch.autograd.grad(T.moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    gr = torch.autograd.grad(grouped_moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    out(
        "moe backward max|triton - grouped_mm| (x, gate_up, down)",
        [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
    )
    out("moe backward run to run bitwise", all(torch.equal(a, b) for a, b in zip(g1, g2)))
    for m in (64, 64 * 272):
        a = torch.randn(m, hdim, device="cuda", dtype=BF)
        out(
            f"moe M={m} ms triton / grouped_mm",
            (round(ms(lambda a=a: run(T.moe, a)), 4), round(ms(lambda a=a: run(grouped_moe, a)), 4)),
        )
    # graph capture of the whole block
    a = torch.randn(64, hdim, device="cuda", dtype=BF)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = run(T.moe, a)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(T.moe, a)
    graph.replay()
    out("moe graph replay == eager (bitwise)", torch.equal(captured, eager))


def linear_backward():
    x = torch.randn(64 * 272, 1024, device="cuda", dtype=BF, requires_grad=True)
    w = (torch.randn(4096, 1024, device="cuda", dtype=BF) * 0.03).requires_grad_()
    go = torch.randn(64 * 272, 4096, device="cuda", dtype=BF)
    g1 = torch.autograd.grad(T.linear(x, w), (x, w), go)
    g2 = torch.autograd.grad(T.linear(x, w), (x, w), go)
    gr = torch.autograd.grad(F.linear(x, w), (x, w), go)
    out(
        "linear backward max|triton - torch|",
        [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
    )
    out("linear backward run to run bitwise", all(torch.equal(a, b) for a, b in zip(g1, g2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    out("device", torch.cuda.get_device_name())
    for section in (gemms, norms, attention, moe, linear_backward):
        try:
            section()
        except Exception as e:  # noqa: BLE001 - report and go on to the next section
            import traceback

            traceback.print_exc()
            out(f"{section.__name__} FAILED", repr(e)[:300])
    if args.out:
        Path(args.out).write_text(json.dumps(R, indent=1, default=str))


if __name__ == "__main__":
    main()
