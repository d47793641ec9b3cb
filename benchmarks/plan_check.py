"""The memory planner against a measured run: peak RSS per rank of a 2-rank CPU (gloo) run of a mid-size model.

    PYTHONPATH=src python benchmarks/plan_check.py --json plan_check.json [--nproc 2] [overrides ...]

Runs `python -m torch.distributed.run --nproc-per-node N` on this file's worker, which composes the config as
train.py does, trains it (`detrl.trainer.train`) and writes its own peak RSS (VmHWM: the process, not its
engine workers) to the out dir; then plans the same config (`detrl.plan`, device cpu, world N) and prints both
side by side with their ratio. Passes (exit 0) when the planner's per-rank figure is within 25% of the
largest measured peak. The engine's KV caches live in its worker processes (not in a rank's RSS): the
comparison leaves the planner's KV pool out (it is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ~50M parameters (8 blocks of hidden 768, MLP 2048, 12 / 4 heads of 64) on the arithmetic task, random init;
# small batches, so the weights, optimizer, gradients and reduce buffers dominate; 2 micro-batches per mini-batch
MODEL = [
    "model.init=random",
    "model.hidden_size=768",
    "model.intermediate_size=2048",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=12",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "steps=2",
    "train_batch_size=2",
    "rollout.n=2",
    "micro_batch_size=1",
    "algo.ppo_mini_batch_size=1",
    "rollout.num_workers=1",
    "logger=none",
    "checkpoint.save_final=false",
]


def peak_rss() -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmHWM")).split()[1]) * 1024


def compose(overrides: list[str]):
    from detrl.plan.__main__ import compose as plan_compose

    return plan_compose(overrides)


def worker(out: Path, overrides: list[str]) -> None:
    import torch

    from detrl import distributed
    from detrl.trainer import train

    torch.set_num_threads(1)
    cfg = compose(overrides)
    distributed.init()
    train(cfg, out / "run")
    (out / f"rank{distributed.rank()}.json").write_text(json.dumps({"peak_rss": peak_rss()}))
    distributed.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    overrides = [*MODEL, *args.overrides]
    out = Path(tempfile.mkdtemp(prefix="plan_check-"))
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.setdefault("DETRL_CACHE_DIR", str(out / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    subprocess.run([*cmd, __file__, "--worker", str(out), *overrides], check=True, env=env, cwd=ROOT)
    measured = [json.loads((out / f"rank{r}.json").read_text())["peak_rss"] for r in range(args.nproc)]

    from detrl.plan import GIB, context_bound, for_config

    cfg = compose(overrides)
    p, s, *_ = for_config(cfg, context_bound(cfg), args.nproc, "cpu", float("inf"))
    kv = p.parts.get("KV pool", 0.0)
    planned = p.per_rank - kv
    ratio = planned / max(measured)
    result = {
        "params": s.params,
        "world_size": args.nproc,
        "measured_peak_rss_gib": [m / GIB for m in measured],
        "planned_per_rank_gib": planned / GIB,
        "planned_peak_phase": p.peak_phase,
        "planned_parts_gib": {k: v / GIB for k, v in p.parts.items()},
        "planned_kv_pool_gib (engine workers, left out)": kv / GIB,
        "ratio_planned_to_measured": ratio,
        "within_25pct": abs(ratio - 1) <= 0.25,
        "overrides": overrides,
    }
    args.json.write_text(json.dumps(result, indent=1))
    print(
        f"{s.params / 1e6:.1f}M params, {args.nproc} ranks: measured peak RSS "
        f"{', '.join(f'{m / GIB:.2f}' for m in measured)} GiB; planned {planned / GIB:.2f} GiB "
        f"({p.peak_phase}); ratio {ratio:.3f} ({'within' if result['within_25pct'] else 'outside'} 25%)"
    )
    return 0 if result["within_25pct"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(main())
