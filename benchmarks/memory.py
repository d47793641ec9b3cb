"""Peak host memory (RSS) of one training update at a real vocabulary and long responses.

    PYTHONPATH=src python benchmarks/memory.py                      # this tree
    PYTHONPATH=/tmp/old/src python benchmarks/memory.py             # another tree (e.g. git archive of main)

A small-width Qwen3 (2 layers, hidden 64) with Qwen3's vocabulary (151,936) scores `--seqs` sequences of a
16-token prompt + `--response` response tokens; `detrl.actor.update` runs one GRPO update (reference
model and KL on, entropy logged) on them. Prints the process's RSS before the update, its peak (VmHWM)
after, and the difference: what the update's activations cost. Run one configuration per process.

    PYTHONPATH=src python benchmarks/memory.py --ranks 1,2 --json rss.json      # whole runs, side by side

`--ranks`: one short `train.py` run per world size (a plain process for 1, torchrun for more) of a ~50M-parameter
Qwen3 (`RANKS_MODEL`, random init: 16 blocks of 3.15M, hidden 512, and the arithmetic task's 64-token vocabulary,
so that the blocks hold nearly every parameter, as in the recipes' models; `EMBEDDING_MODEL` is the former
embedding-dominated one: a 151,936 x 320 tied embedding, 48.6M of ~50M, which no per-block scheme shrinks below
the root group: `--model embedding`); each rank reports its peak RSS (VmHWM, the trainer process alone: the
engine's forked workers not counted); `--json` writes them with each world size's ratio to 1 rank.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def rss_mib() -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


RANKS_MODEL = [  # ~50M parameters, nearly all in the blocks (the recipes' shape): 16 x 3.15M + a 64 x 512 embedding
    "model.init=random",
    "model.vocab_size=64",
    "model.hidden_size=512",
    "model.intermediate_size=1536",
    "model.num_hidden_layers=16",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "steps=2",
    "train_batch_size=4",
    "rollout.n=4",
    "micro_batch_size=4",
    "algo.ppo_mini_batch_size=2",
    "rollout.num_workers=1",
    "logger=none",
    "checkpoint.save_final=false",
    "device=cpu",
]


EMBEDDING_MODEL = [  # ~50M parameters: 151,936 x 320 tied embedding (48.6M) + 4 layers
    "model.init=random",
    "model.vocab_size=151936",
    "model.hidden_size=320",
    "model.intermediate_size=640",
    "model.num_hidden_layers=4",
    *RANKS_MODEL[8:],
]
MODELS = {"blocks": RANKS_MODEL, "embedding": EMBEDDING_MODEL}


def rank_worker(out: Path, overrides: list[str]) -> None:
    """One training run (under torchrun: this rank's part) -> out/rss-<rank>.json with its peak RSS."""
    from hydra import compose, initialize_config_dir

    import detrl
    from detrl import distributed
    from detrl.config import register_configs, to_typed
    from detrl.trainer import train

    register_configs()
    conf = Path(detrl.__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_typed(compose("train", overrides=overrides))
    train(cfg, out / "run")
    rank = distributed.rank()
    (out / f"rss-{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_mib": rss_mib()[1]}))


def side_by_side(worlds: list[int], overrides: list[str], json_path: str | None) -> dict:
    """Peak RSS per rank of the same run on each world size, one after the other on this machine."""
    res: dict = {"overrides": overrides, "worlds": {}}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    for w in worlds:
        out = Path(tempfile.mkdtemp(prefix=f"rss-w{w}-"))
        launch = [sys.executable] + (
            ["-m", "torch.distributed.run", "--nproc-per-node", str(w)] if w > 1 else []
        )
        subprocess.run([*launch, __file__, "--worker", str(out), "--", *overrides], check=True, env=env)
        peaks = [json.loads((out / f"rss-{r}.json").read_text())["peak_rss_mib"] for r in range(w)]
        res["worlds"][str(w)] = {"peak_rss_mib_per_rank": peaks, "max_mib": max(peaks)}
    one = res["worlds"].get("1", {}).get("max_mib")
    for v in res["worlds"].values():
        v["ratio_to_1_rank"] = v["max_mib"] / one if one else None
    print(json.dumps(res, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    if "--worker" in sys.argv:  # python memory.py --worker DIR -- overrides...
        i = sys.argv.index("--worker")
        rank_worker(Path(sys.argv[i + 1]), sys.argv[sys.argv.index("--") + 1 :])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="", help="e.g. 1,2: whole runs on these world sizes, peak RSS per rank")
    p.add_argument("--json", default=None, help="write the --ranks results here")
    p.add_argument("--model", default="blocks", choices=sorted(MODELS), help="--ranks: which ~50M model")
    p.add_argument("overrides", nargs="*", help="train.py overrides after RANKS_MODEL's (--ranks)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--determinism", default="on")
    p.add_argument(
        "--rollout",
        type=int,
        default=0,
        help="instead: one engine batch of this many requests "
        "decoding --response tokens (sampling noise memory)",
    )
    args = p.parse_args()
    if args.ranks:
        side_by_side([int(w) for w in args.ranks.split(",")], MODELS[args.model] + args.overrides, args.json)
        return
    torch.set_num_threads(1)

    from hydra import compose, initialize_config_dir

    import detrl
    from detrl import actor, distributed
    from detrl.actor import ActorSpec
    from detrl.collect import StepBatch
    from detrl.config import register_configs, to_typed
    from detrl.determinism import setup
    from detrl.models.build import build_model
    from detrl.models.forward import rope_tables
    from detrl.runtime import ops_for

    conf = Path(detrl.__file__).resolve().parents[2] / "conf"
    prompt, n = 16, args.seqs
    ctx = -(-(prompt + args.response) // 8) * 8
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_typed(
            compose(
                "train",
                overrides=[
                    f"determinism={args.determinism}",
                    "logger=none",
                    "model.init=random",
                    f"model.vocab_size={args.vocab}",
                    f"model.hidden_size={args.hidden}",
                    f"model.intermediate_size={2 * args.hidden}",
                    "model.head_dim=16",
                    f"model.max_position_embeddings={ctx}",
                    f"rollout.max_new_tokens={args.response}",
                    "train_batch_size=1",
                    f"rollout.n={n}",
                    f"micro_batch_size={n}",
                ],
            )
        )
    det = setup(cfg.determinism, 0)
    model = build_model(cfg.model, seed=0).train()
    ref = build_model(cfg.model, seed=0).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (n, ctx), generator=g)
    mask = torch.zeros(n, ctx - 1)
    mask[:, prompt - 1 : prompt - 1 + args.response] = 1.0
    versions = torch.where(mask > 0, 0, -1)
    batch = StepBatch(
        [],
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n, dtype=torch.long),
        ids,
        mask,
        torch.full((n, ctx - 1), -12.0) * mask,
        versions,
    )
    adv = torch.randn(n, generator=g)
    rope = rope_tables(model.config, ctx)
    if args.rollout:
        from detrl.rollout import EmbeddedEngine, Request, SamplingParams

        engine = EmbeddedEngine(model, ops_for(det), ctx, SamplingParams(1.0, 1.0, args.response, ()), seed=0)
        reqs = [Request(i, 0, tuple(ids[0, :prompt].tolist()), seed=i) for i in range(args.rollout)]
        before, _ = rss_mib()
        t0 = time.perf_counter()
        out = engine.run_batch(reqs)
        _, peak = rss_mib()
        print(
            f"rollout batch={args.rollout} vocab={args.vocab} new tokens={len(out[0].tokens)}: RSS before "
            f"{before:.0f} MiB, peak {peak:.0f} MiB, +{peak - before:.0f} MiB, {time.perf_counter() - t0:.1f} s"
        )
        return
    before, _ = rss_mib()
    t0 = time.perf_counter()
    dp = distributed.DataParallel(model, ordered=True)
    actor.update(
        model, ref, opt, batch, adv, ActorSpec.from_config(cfg), ops_for(det), ctx, rope, 0, dp, None
    )
    seconds = time.perf_counter() - t0
    _, peak = rss_mib()
    new_api = "mini" if "ppo_mini_batch_size" in inspect.getsource(type(cfg.algo)) else "old"
    print(
        f"code={new_api} vocab={args.vocab} response={args.response} seqs={n} hidden={args.hidden} "
        f"determinism={args.determinism}: RSS before {before:.0f} MiB, peak {peak:.0f} MiB, "
        f"update +{peak - before:.0f} MiB, {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
