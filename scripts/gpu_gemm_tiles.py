"""Issue 16 on a GPU: does the invariant gemm's tiling change a row's bits, or only its chunking of K? And what
does each tiling cost against cuBLAS at decode (64 rows) and training (64 x 272 rows) sizes?

    bash scripts/gpu_run.sh python3 scripts/gpu_gemm_tiles.py [--out tiles.json]

For every gemm shape of the two models: the reference is `gemm` with the fixed tiles, unsplit, on 300 rows.
Each tiling (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), unsplit and split-K (one program per K chunk, then an
ordered sum), is run on the first 1, 7, 64 and 300 of those rows and inside a 17,408-row call, and compared
bitwise with the reference rows. Then times (CUDA graphs, triton.testing.do_bench_cudagraph) of cuBLAS
(F.linear), `gemm` as it launches itself (`tiles_for`) and each tiling. Call F (docs/gpu/issue16/tiles.json) found
every tiling bit-identical to the fixed tiles, and timed one more candidate since dropped (an M-dependent chunking
for determinism off's decode: slower than cuBLAS at 64 rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

from detrl.models import triton_ops as T  # noqa: E402

BF = torch.bfloat16
SHAPES = {
    "0.6B qkv": (1024, 4096),
    "0.6B o": (2048, 1024),
    "0.6B gate_up": (1024, 6144),
    "0.6B down": (3072, 1024),
    "0.6B lm_head": (1024, 151936),
    "moe qkv": (2048, 5120),
    "moe o": (4096, 2048),
    "moe router": (2048, 128),
}
TILINGS = [
    T.Tiles(64, 64, 64, 4, 3),
    T.Tiles(64, 64, 64, 4, 4),
    T.Tiles(64, 32, 64, 4, 4),
    T.Tiles(64, 128, 64, 4, 3),
    T.Tiles(64, 64, 128, 4, 3),
    T.Tiles(64, 64, 32, 4, 4),
    T.Tiles(128, 128, 64, 8, 3),
    T.Tiles(128, 256, 64, 8, 3),
    T.Tiles(128, 128, 64, 4, 4),
    T.Tiles(16, 64, 64, 4, 4),
    T.Tiles(32, 64, 128, 4, 4),
]
BIG = 64 * 272


def name(t: T.Tiles) -> str:
    return f"{t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}"


def us(fn) -> float:
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    print(f"{res['device']}, torch {torch.__version__}; chunk_k(K) = min({T.CHUNK_K}, K)", flush=True)
    for label, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=BF) * k**-0.5
        x = torch.randn(BIG, k, device="cuda", dtype=BF)
        fixed = T.FIXED
        ref = T.gemm(x[:300], w, tiles=fixed, split=False)
        cublas_err = (F.linear(x[:300], w).float() - ref.float()).abs().max().item()
        row: dict = {"K": k, "N": n, "max|fixed - cublas|": cublas_err, "bits": {}, "us": {}}
        for t in TILINGS:
            same = []
            for split in (False, True):
                for m in (1, 7, 64, 300):
                    same.append(torch.equal(T.gemm(x[:m], w, tiles=t, split=split), ref[:m]))
            if n < 100000:
                same.append(torch.equal(T.gemm(x, w, tiles=t, split=False)[:300], ref))
            row["bits"][name(t)] = all(same)
        xs = {64: x[:64], 256: x[:256], BIG: x}
        for m, a in xs.items():
            if n > 100000 and m == BIG:
                continue
            times = {
                "cublas": us(lambda a=a, w=w: F.linear(a, w)),
                "tiles_for": us(lambda a=a, w=w: T.gemm(a, w)),
            }
            for t in TILINGS:
                if m > 256 and t.bm < 64:
                    continue
                times[name(t)] = us(lambda a=a, t=t, w=w: T.gemm(a, w, tiles=t))
            row["us"][m] = times
        res["shapes"][label] = row
        print(f"\n== {label} K={k} N={n}: max|fixed - cublas| {cublas_err:.4g}", flush=True)
        print(
            "  same bits as the fixed tiles (unsplit and split, rows 1/7/64/300, inside 17408):",
            {kk: v for kk, v in row["bits"].items()},
            flush=True,
        )
        for m, times in row["us"].items():
            best = min((v, kk) for kk, v in times.items() if kk != "cublas")
            print(
                f"  M={m}: cublas {times['cublas']:.1f} us; tiles_for {times['tiles_for']:.1f}; "
                f"best {best[1]} {best[0]:.1f}; " + ", ".join(f"{kk} {v:.1f}" for kk, v in times.items()),
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
