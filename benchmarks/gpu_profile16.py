"""Issue 16: where determinism=on's time goes on one GPU, against off, for the engine's decode and the trainer's
logprob forward + backward (the two halves of a GRPO step), each under its mode's torch flags (determinism.setup).

    python benchmarks/gpu_profile16.py [--model qwen3_0p6b] [--batch 64] [--modes on,off]

Per mode: ms per decode step (CUDA graphs, seeded requests under on as the trainer sends them), ms of one
sequence_logprobs forward + backward on batch x ctx tokens, and the top kernels of each by device time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from gpu import NEW, prompts, random_model, timed  # noqa: E402

from detrl import determinism as det_mod  # noqa: E402
from detrl.config import register_configs  # noqa: E402
from detrl.models.forward import rope_tables  # noqa: E402
from detrl.models.logprobs import sequence_logprobs  # noqa: E402
from detrl.rollout.base import Request, SamplingParams  # noqa: E402
from detrl.rollout.cuda import CudaEngine  # noqa: E402


def top(prof, n=18) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default="qwen3_0p6b")
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    register_configs()
    model = random_model(args.model)
    ctx = -(-(len(prompts(1)[0]) + NEW) // 8) * 8
    for mode in args.modes.split(","):
        det = det_mod.setup(mode == "on", 0, "cuda", torch.bfloat16)
        reqs = [
            Request(i // 8, i % 8, tuple(p), seed=det.sampling_seed(1, i // 8, i % 8))
            for i, p in enumerate(prompts(args.batch))
        ]
        eng = CudaEngine(
            model,
            det.ops,
            ctx,
            SamplingParams(1.0, 1.0, NEW, ()),
            seed=0,
            max_batch_size=args.batch,
            fixed_routing=det.fixed_routing,
            dtype=torch.bfloat16,
        )
        eng.generate(reqs)  # warm: captures the graphs
        step_ms = timed(lambda eng=eng, reqs=reqs: eng.generate(reqs)) / NEW * 1e3
        print(
            f"[{mode}] {det.ops.name}: {step_ms:.3f} ms per decode step (batch {args.batch}, graphs)",
            flush=True,
        )
        if not args.no_profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                eng.generate(reqs)
                torch.cuda.synchronize()
            print(top(prof), flush=True)
        eng.close()
        del eng
        rope = rope_tables(model.config, ctx, "cuda", torch.bfloat16)
        ids = torch.randint(3, 1000, (args.batch, ctx), device="cuda")
        mask = torch.zeros(args.batch, ctx - 1, device="cuda")
        mask[:, len(prompts(1)[0]) - 1 :] = 1

        def fwd_bwd(ids=ids, mask=mask, ops=det.ops, rope=rope):
            tok, ent = sequence_logprobs(model, ids, mask, ops, ctx, rope, 1.0, entropy=True)
            (tok.sum() + 0.01 * ent.sum()).backward()
            model.zero_grad(set_to_none=True)

        fwd_bwd()  # warm
        print(
            f"[{mode}] trainer logprobs fwd+bwd {args.batch}x{ctx}: {timed(fwd_bwd) * 1e3:.1f} ms", flush=True
        )
        if not args.no_profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fwd_bwd()
                torch.cuda.synchronize()
            print(top(prof), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
