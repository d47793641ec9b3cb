"""A long-context `train.py` run on CPU, with the KV the engine held vs its pool and the pool's cap.

    python benchmarks/long_context.py --json out.json            # 1 prompt x 16 samples x up to 2048 new tokens
    python benchmarks/long_context.py -- rollout.max_new_tokens=512   # other overrides after --

The trainer of `python train.py` (the same `detrl.trainer.train`, in this process, config composed by Hydra) with
LONG's overrides (then the given ones): the default model from a random init, sampled at temperature 0.01 (a
random tiny model stops at the stop token after ~50 tokens at temperature 1; near-greedy, most of its samples run
to the limit), `model.max_position_embeddings` raised to hold the context. train.py logs no engine statistics;
this reads them from the run's engine after the step: per worker, the KV bytes held at the peak, the pool's
bytes and preemptions, against the automatic pool's cap (`rollout.kv_pool_max_tokens` x bytes per token) and what
the static engine's per-row caches would take (rows x ctx_len x bytes per token). JSON: `timing_s`,
`response_length`, `kv` (per worker), `mismatch`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import detrl  # noqa: F401 - before torch: it sets how idle OpenMP threads wait (detrl/__init__.py)

# isort: split
from hydra import compose, initialize_config_dir

from detrl.config import register_configs, to_typed

CONF = str(Path(__file__).resolve().parents[1] / "conf")
LONG = [
    "model.init=random",
    "model.max_position_embeddings=2064",
    "rollout.temperature=0.01",
    "rollout.n=16",
    "rollout.max_new_tokens=2048",
    "train_batch_size=1",
    "steps=1",
    "logger=none",
    "checkpoint.save_final=false",
]


def run(overrides: list[str], out: Path) -> tuple[dict, object, float, int]:
    """One train() run; -> (its last metrics row, its engine, wall seconds, rows a step samples)."""
    from detrl import trainer
    from detrl.analysis import load_metrics

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_typed(compose("train", overrides=[*LONG, *overrides]))
    runs = []
    start = trainer.start

    def keep(*a, **k):  # the run's engine, read after the step (its statistics outlive close())
        runs.append(start(*a, **k))
        return runs[-1]

    trainer.start = keep
    t = time.perf_counter()
    try:
        trainer.train(cfg, out)
    finally:
        trainer.start = start
    rows = cfg.train_batch_size * cfg.rollout.n
    return load_metrics(out)[-1], runs[0].engine, time.perf_counter() - t, rows


def kv_report(engine, rows: int) -> dict:
    """Per worker: KV bytes at the peak, pool bytes, preemptions; the cap and the static engine's caches."""
    c = engine.model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32 keys and values
    from omegaconf import OmegaConf

    cap = OmegaConf.load(Path(CONF) / "rollout" / "embedded.yaml").kv_pool_max_tokens
    workers = {w: {k: s[k] for k in ("kv_bytes_peak", "kv_pool_bytes", "preemptions", "hit_blocks")}
               for w, s in sorted(engine.stats.items())}  # fmt: skip
    return {
        "per_worker": workers,
        "bytes_per_token": per_token,
        "ctx_len": engine.ctx_len,
        "pool_cap_bytes": cap * per_token,
        "static_caches_bytes": rows * engine.ctx_len * per_token,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --), applied after LONG's")
    args = ap.parse_args()
    print(f"overrides: {' '.join([*LONG, *args.overrides])}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        row, engine, wall, rows = run(args.overrides, Path(tmp))
    out = {
        "wall_s": wall,
        "timing_s": {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing_s/")},
        "response_length": {
            k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("response_length/")
        },
        "mismatch": row.get("mismatch/train_rollout_logprob_abs_diff"),
        "kv": kv_report(engine, rows),
        "overrides": [*LONG, *args.overrides],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
