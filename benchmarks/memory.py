"""Peak host memory (RSS) of one training update at a real vocabulary and long responses.

    PYTHONPATH=src python benchmarks/memory.py                      # this tree
    PYTHONPATH=/tmp/old/src python benchmarks/memory.py             # another tree (e.g. git archive of main)

A small-width Qwen3 (2 layers, hidden 64) with Qwen3's vocabulary (151,936) scores `--seqs` sequences of a
16-token prompt + `--response` response tokens; `detrl.trainer.update` runs one GRPO update (reference
model and KL on, entropy logged) on them. Prints the process's RSS before the update, its peak (VmHWM)
after, and the difference: what the update's activations cost. Run one configuration per process.
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

import torch


def rss_mib() -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    p = argparse.ArgumentParser()
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
    torch.set_num_threads(1)

    from hydra import compose, initialize_config_dir

    import detrl
    from detrl.collect import StepBatch
    from detrl.config import register_configs, to_typed
    from detrl.determinism import setup
    from detrl.models.build import build_model
    from detrl.models.forward import rope_tables
    from detrl.trainer import update

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

        engine = EmbeddedEngine(model, det.ops, ctx, SamplingParams(1.0, 1.0, args.response, ()), seed=0)
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
    update(model, ref, opt, batch, adv, cfg, det.ops, ctx, rope, version=0)
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
