"""Where a decode step's time goes: the CUDA engine's step (compiled stages, no graph) under torch.profiler.

    python benchmarks/gpu_profile.py [--batch 64] [--model qwen3_0p6b]

Prints the per-step wall time with and without the CUDA graph and the top kernels by device time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from gpu import NEW, prompts, random_model, timed  # noqa: E402

from detrl.config import register_configs  # noqa: E402
from detrl.models.ops import CUDA_DEFAULT_OPS  # noqa: E402
from detrl.rollout.base import Request, SamplingParams  # noqa: E402
from detrl.rollout.cuda import CudaEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default="qwen3_0p6b")
    args = ap.parse_args()
    register_configs()
    model = random_model(args.model)
    ctx = -(-(len(prompts(1)[0]) + NEW) // 8) * 8
    ops = dataclasses.replace(CUDA_DEFAULT_OPS, dtype=torch.bfloat16)
    reqs = [Request(i // 8, i % 8, tuple(p)) for i, p in enumerate(prompts(args.batch))]
    for graphs in (True, False):
        eng = CudaEngine(
            model,
            ops,
            ctx,
            SamplingParams(1.0, 1.0, NEW, ()),
            seed=0,
            max_batch_size=args.batch,
            fixed_routing=False,
            graphs=graphs,
        )
        eng.generate(reqs)  # warm: captures the graphs
        step_ms = timed(lambda eng=eng: eng.generate(reqs)) / NEW * 1e3
        print(f"graphs={graphs}: {step_ms:.3f} ms per decode step (batch {args.batch})", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.generate(reqs[: args.batch])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
