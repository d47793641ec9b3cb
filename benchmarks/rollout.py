"""Embedded engine tokens/s vs transformers `generate(do_sample=True)`, side by side in one process.

    python benchmarks/rollout.py                      # a default training step's rollout: 32 prompts x 8
    python benchmarks/rollout.py --prompts 8 --n 4    # vs_trl.py's batch: 8 prompts x 4 samples

The same tiny dense Qwen3 (seed-0 init) and the same prompts, each sampled n times; every sequence
generates exactly `--new-tokens` tokens (no stop token), so tokens/s = prompts x n x new tokens /
seconds. The engine runs with the default config's workers and batch cap; `generate` gets the whole
batch in one call (num_return_sequences=n). Runs alternate; the table shows medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detrl  # noqa: E402, F401 - before torch: it sets how idle OpenMP threads wait (detrl/__init__.py)

# isort: split
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from detrl.config import ModelConfig  # noqa: E402
from detrl.data import ArithmeticTask, build_tokenizer  # noqa: E402
from detrl.determinism import setup  # noqa: E402
from detrl.rollout import EmbeddedEngine, Request, SamplingParams  # noqa: E402
from detrl.warmstart import encode  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts (train_batch_size)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    default = OmegaConf.load(CONF / "rollout" / "embedded.yaml")  # the engine as a default run builds it
    ap.add_argument(
        "--workers", type=int, default=default.num_workers, help="engine workers (rollout.num_workers)"
    )
    ap.add_argument(
        "--max-batch-size",
        type=int,
        default=default.max_batch_size,
        help="engine batch cap (rollout.max_batch_size)",
    )
    args = ap.parse_args()
    from detrl.models.build import build_model

    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    prompts = [encode(tok, task[i].prompt) for i in range(args.prompts)]
    model = build_model(ModelConfig(), seed=0).eval()
    ctx = -(-(max(map(len, prompts)) + args.new_tokens) // 8) * 8
    params = SamplingParams(1.0, 1.0, args.new_tokens, ())

    def engine(on: bool):  # built once, as a run builds it; its workers start at the warm-up call
        det = setup(on, 0)
        eng = EmbeddedEngine(
            model,
            det.ops,
            ctx,
            params,
            seed=0,
            num_workers=args.workers,
            max_batch_size=args.max_batch_size,
            fixed_routing=det.fixed_routing,
        )
        reqs = [
            Request(det.prompt_uid(i), j, tuple(p), det.sampling_seed(1, det.prompt_uid(i), j))
            for i, p in enumerate(prompts)
            for j in range(args.n)
        ]

        def run():
            setup(on, 0)
            t = time.perf_counter()
            res = eng.generate(reqs)
            assert all(len(r.tokens) == args.new_tokens for r in res)
            return time.perf_counter() - t

        return run

    width = max(map(len, prompts))
    left = torch.zeros(len(prompts), width, dtype=torch.long)  # generate wants left padding
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        left[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1

    def hf_run():
        setup(False, 0)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=left,
                attention_mask=attn,
                do_sample=True,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                num_return_sequences=args.n,
                pad_token_id=0,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
            )
        assert out.shape == (len(prompts) * args.n, width + args.new_tokens)
        return time.perf_counter() - t

    runs = {
        "transformers generate(do_sample=True)": hf_run,
        "detrl engine, determinism=off": engine(False),
        "detrl engine, determinism=on": engine(True),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(fn())
    base = statistics.median(times["transformers generate(do_sample=True)"])
    tokens = len(prompts) * args.n * args.new_tokens
    print(
        f"\n{args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens, engine: {args.workers} "
        f"worker(s), batches of <= {args.max_batch_size}; CPU ({torch.get_num_threads()} threads), median of "
        f"{args.repeats}\n"
    )
    print("| sampler | median (s) | tokens/s | vs generate |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.4f} | {tokens / med:,.0f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
