"""Embedded engine tokens/s vs transformers `generate(do_sample=True)`, side by side in one process.

    python benchmarks/rollout.py                      # a default training step's rollout: 32 prompts x 8
    python benchmarks/rollout.py --prompts 8 --n 4    # vs_trl.py's batch: 8 prompts x 4 samples
    python benchmarks/rollout.py --workload variable --rounds 3 --json out.json   # static / continuous / generate
    python benchmarks/rollout.py --workload long --rounds 1      # 2 prompts x 16 x 2048 tokens, KV bounded by the pool

`--workload variable|long` (see `variable`): the previous (static) engine, the continuous engine (its KV pool as a
default run sizes it: automatic, capped at rollout.kv_pool_max_tokens, unless --kv-pool-tokens) and transformers
`generate` (at the faster of the process's threads and one: `generate_is`) on the same requests in alternating
rounds (`--rounds`, medians), JSON keys
`tokens_per_s.{static,continuous,generate}`, `kv_bytes_peak.{static,continuous}`, `prefix` (prompt blocks taken
from the cache), `ratio` (side-by-side ratios: what holds on a shared machine).

The same tiny dense Qwen3 (seed-0 init) and the same prompts, each sampled n times; every sequence
generates exactly `--new-tokens` tokens (no stop token), so tokens/s = prompts x n x new tokens /
seconds. The engine runs with the default config's workers and batch cap; `generate` gets the whole
batch in one call (num_return_sequences=n), at the process's intra-op threads and at one (on 2 cores
its small ops run faster at one): ratios are against the faster, `generate` at its best. Runs alternate;
the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import detrl  # noqa: F401 - before torch: it sets how idle OpenMP threads wait (detrl/__init__.py)

# isort: split
import torch
from omegaconf import OmegaConf

from detrl.config import ModelConfig
from detrl.data import ArithmeticTask, build_tokenizer
from detrl.determinism import setup
from detrl.distributed import intra_op_threads
from detrl.rollout import EmbeddedEngine, Request, SamplingParams
from detrl.rollout.paged import PoolSpec
from detrl.runtime import ops_for
from detrl.warmstart import encode

CONF = Path(__file__).resolve().parents[1] / "conf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts (train_batch_size)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=512, help="variable workload: max_new_tokens")
    ap.add_argument("--repeats", type=int, default=7)
    default = OmegaConf.load(CONF / "rollout" / "embedded.yaml")  # the engine as a default run builds it
    ap.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=default.kv_pool_tokens,
        help="variable/long: the continuous engine's pool per worker (rollout.kv_pool_tokens; 0 = automatic)",
    )
    ap.add_argument(
        "--kv-pool-max-tokens",
        type=int,
        default=default.kv_pool_max_tokens,
        help="variable/long: the cap on an automatic pool (rollout.kv_pool_max_tokens)",
    )
    ap.add_argument(
        "--workers", type=int, default=default.num_workers, help="engine workers (rollout.num_workers)"
    )
    ap.add_argument(
        "--max-batch-size",
        type=int,
        default=default.max_batch_size,
        help="engine batch cap (rollout.max_batch_size)",
    )
    ap.add_argument("--workload", choices=("fixed", "variable", "long"), default="fixed")
    ap.add_argument(
        "--rounds", type=int, default=3, help="variable/long: alternating rounds (median per engine)"
    )
    ap.add_argument("--json", type=Path, help="write the variable workload's numbers here")
    args = ap.parse_args()
    if args.workload == "long":  # 2 prompts x 16 samples x 2048 tokens unless given
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for flag, key, value in (
            ("--prompts", "prompts", 2),
            ("--n", "n", 16),
            ("--max-new", "max_new", 2048),
        ):
            if flag not in given:
                setattr(args, key, value)
    changed = {k: v for k, v in vars(args).items() if v != ap.get_default(k)}
    print(f"settings that differ from the defaults: {changed or 'none'}")
    if args.workload in ("variable", "long"):
        return variable(args)
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
            ops_for(det),
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

    def hf_run(threads: int | None):
        setup(False, 0)
        t = time.perf_counter()
        with torch.no_grad(), intra_op_threads(threads):
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

    threads = torch.get_num_threads()
    generate_rows = {
        f"transformers generate(do_sample=True), {threads} threads": partial(hf_run, None),
        "transformers generate(do_sample=True), 1 thread": partial(hf_run, 1),
    }
    runs = {
        **generate_rows,
        "detrl engine, determinism=off": engine(False),
        "detrl engine, determinism=on": engine(True),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(fn())
    base = min(statistics.median(times[k]) for k in generate_rows)  # generate at its best
    tokens = len(prompts) * args.n * args.new_tokens
    print(
        f"\n{args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens, engine: {args.workers} "
        f"worker(s), batches of <= {args.max_batch_size}; CPU ({threads} threads), median of "
        f"{args.repeats}; vs the faster generate row\n"
    )
    print("| sampler | median (s) | tokens/s | vs generate at its best |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.4f} | {tokens / med:,.0f} | {base / med:.2f}x |")


def variable(args) -> None:
    """Random prompts x n samples on the default 2-layer shape (seed-0 init), the same requests through the static
    engine, the continuous engine and transformers generate, in alternating rounds (median per engine).
    variable: prompts of 8..64 tokens, stop token 2 sampled (about 1 in 64 steps: lengths from 1 to --max-new,
    most short). long: 2 prompts x 16 samples, 2048 new tokens, no stop token (every row runs to the limit:
    the KV the pool holds is what bounds it)."""
    from detrl.models.build import build_model

    new, n, prompts = args.max_new, args.n, args.prompts
    stops = (2,) if args.workload == "variable" else ()
    g = torch.Generator().manual_seed(0)
    lens = [8 + int(x) for x in torch.randint(0, 57, (prompts,), generator=g)]
    ids = [tuple(int(t) for t in torch.randint(3, 64, (k,), generator=g)) for k in lens]
    ctx = -(-(max(lens) + new) // 8) * 8
    model = build_model(ModelConfig(max_position_embeddings=max(64, ctx)), seed=0).eval()
    params = SamplingParams(1.0, 1.0, new, stops)
    det = setup(True, 0)
    reqs = [Request(i, j, p, det.sampling_seed(1, i, j)) for i, p in enumerate(ids) for j in range(n)]
    engines = {}
    for name in ("static", "continuous"):
        pool = (args.kv_pool_tokens, args.kv_pool_max_tokens) if name == "continuous" else (0, 0)
        engines[name] = EmbeddedEngine(model, ops_for(det), ctx, params, seed=0, num_workers=args.workers,
                                       max_batch_size=args.max_batch_size, scheduler=name,
                                       pool=PoolSpec(kv_pool_tokens=pool[0], kv_pool_max_tokens=pool[1]))  # fmt: skip
        engines[name].generate(reqs[: 2 * n])  # warm-up: the workers start
    gen = {
        f"generate_{torch.get_num_threads()}threads": None,
        "generate_1thread": 1,
    }  # generate, at its best below
    seconds: dict[str, list[float]] = {"static": [], "continuous": [], **{k: [] for k in gen}}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):  # alternating: a shared machine's load falls on every engine alike
        for name, eng in engines.items():
            eng.update_weights(model.state_dict())  # as a step does: pools released, prefix cache cleared
            t = time.perf_counter()
            res = eng.generate(reqs)
            seconds[name].append(time.perf_counter() - t)
            tokens[name] = sum(len(r.tokens) for r in res)
        for key, threads in gen.items():
            with intra_op_threads(threads):
                sec, tokens[key] = _hf_variable(model, ids, n, new, stops)
            seconds[key].append(sec)
    best = min(gen, key=lambda k: statistics.median(seconds[k]))
    seconds["generate"], tokens["generate"] = seconds[best], tokens[best]
    out = _summary(args, engines, seconds, tokens, res, ids, n)
    out["generate_is"] = best  # tokens_per_s.generate: the faster thread count's
    out["workload"] = {"name": args.workload, "prompts": prompts, "n": n, "max_new_tokens": new,
                       "prompt_lengths": [min(lens), max(lens)], "stop_token_ids": list(stops),
                       "workers": args.workers, "max_batch_size": args.max_batch_size, "ctx_len": ctx,
                       "rounds": args.rounds, "kv_pool_tokens": args.kv_pool_tokens,
                       "kv_pool_max_tokens": args.kv_pool_max_tokens}  # fmt: skip
    for eng in engines.values():
        eng.close()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def _summary(args, engines, seconds, tokens, res, ids, n) -> dict:
    """Medians, tokens/s, KV peaks, prefix-cache counts and the ratios measured side by side."""
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out: dict = {"seconds": med, "seconds_all": seconds, "tokens": tokens,
                 "tokens_per_s": {k: tokens[k] / med[k] for k in med},
                 "kv_bytes_peak": {k: e.stat("kv_bytes_peak") for k, e in engines.items()}}  # fmt: skip
    cont = engines["continuous"]
    out["kv_pool_bytes"] = cont.stat("kv_pool_bytes")
    full = sum((len(p) - 1) // cont.block_size for p in ids) * n  # prompt blocks n samples would compute
    out["prefix"] = {"hit_blocks": cont.stat("hit_blocks"), "block_size": cont.block_size,
                     "preemptions": cont.stat("preemptions"), "full_prompt_blocks": full}  # fmt: skip
    lens = [len(r.tokens) for r in res]
    out["lengths"] = {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)}
    tps, kv = out["tokens_per_s"], out["kv_bytes_peak"]
    out["ratio"] = {
        "continuous_vs_static_tokens_per_s": tps["continuous"] / tps["static"],
        "continuous_vs_generate_tokens_per_s": tps["continuous"] / tps["generate"],
        "continuous_vs_static_kv_peak": kv["continuous"] / kv["static"] if kv["static"] else None,
    }
    return out


def _hf_variable(model, ids, n, new, stops) -> tuple[float, int]:
    """transformers generate on the same prompts (left-padded), stopping rows at the stop token; -> (s, tokens)."""
    width = max(map(len, ids))
    left = torch.zeros(len(ids), width, dtype=torch.long)
    attn = torch.zeros_like(left)
    for i, p in enumerate(ids):
        left[i, width - len(p) :], attn[i, width - len(p) :] = torch.tensor(p), 1
    setup(False, 0)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=left, attention_mask=attn, do_sample=True, max_new_tokens=new,
                             min_new_tokens=0 if stops else new, num_return_sequences=n,
                             eos_token_id=stops[0] if stops else None, pad_token_id=0, top_k=0)  # fmt: skip
    sec = time.perf_counter() - t
    gen = out[:, width:]
    if not stops:
        return sec, gen.numel()
    ended = (gen == stops[0]).int().cumsum(-1)
    tokens = int(
        ((ended == 0) | ((ended == 1) & (gen == stops[0]))).sum()
    )  # up to and including the stop token
    return sec, tokens


if __name__ == "__main__":
    main()
