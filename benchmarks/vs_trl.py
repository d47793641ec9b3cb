"""detrl's GRPO step vs TRL's GRPOTrainer on the same work, side by side in one process.

    pip install -e '.[bench]' && python benchmarks/vs_trl.py [--steps 12] [--rounds 2]

Same model (tiny dense Qwen3 from conf/model/qwen3.yaml, same seed-0 init), same prompts (8 arithmetic
prompts per step), 4 samples each, up to 16 new tokens, GRPO without a reference model, one optimizer
step per rollout batch, the clip ratio's old logprobs taken from the gradient pass on both sides (TRL at
num_iterations=1; detrl's algo.old_logprobs=current), CPU, and the same numerics: fp32 weights and compute,
no autocast, no activation recomputation. TRL's GRPOConfig defaults are GPU defaults (bf16=True autocast,
gradient_checkpointing=True): the matched rows turn both off; a last TRL row keeps its defaults, for
reference only (other work). The matched TRL row runs at the process's intra-op threads and at one thread (on
2 cores TRL's step is faster at one: its ops are small), and the ratios are taken against the faster of the two,
TRL at its best; detrl runs as `python train.py` does, plus `off` at one thread.
Runs alternate (the table's rows, in order) for `--rounds` rounds; the first 2 steps of every run are warm-up;
the table shows the median step time over the rest, and the median rollout + reward part of it (detrl's
`timing_s/rollout`; TRL's `_generate_and_score_completions`, timed around the trainer's own method).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import detrl  # noqa: F401 - before torch: it sets how idle OpenMP threads wait (detrl/__init__.py)

# isort: split
import torch
from hydra import compose, initialize_config_dir

from detrl.config import ModelConfig, register_configs, to_typed
from detrl.data import ArithmeticTask, build_tokenizer, exact_match_reward
from detrl.distributed import intra_op_threads
from detrl.models.build import build_model

CONF = str(Path(__file__).resolve().parents[1] / "conf")
PROMPTS, SAMPLES, NEW_TOKENS, WARMUP = 8, 4, 16, 2


def detrl_steps(determinism: str, steps: int, out: Path) -> dict[str, list[float]]:
    from detrl.analysis import load_metrics
    from detrl.trainer import train

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_typed(
            compose(
                "train",
                overrides=[
                    f"determinism={determinism}",
                    f"steps={steps}",
                    f"train_batch_size={PROMPTS}",
                    f"rollout.n={SAMPLES}",
                    f"rollout.max_new_tokens={NEW_TOKENS}",
                    "algo.use_kl_loss=false",
                    "model.init=random",
                    "seed=0",
                    f"micro_batch_size={PROMPTS * SAMPLES}",
                    "algo.ppo_mini_batch_size=0",
                    "logger=none",
                    "checkpoint.save_final=false",
                    "algo.old_logprobs=current",  # TRL's work at num_iterations=1
                ],
            )
        )
    train(cfg, out)
    rec = load_metrics(out)[WARMUP:]
    return {"step": [r["timing_s/step"] for r in rec], "rollout": [r["timing_s/rollout"] for r in rec]}


# TRL with detrl's numerics: fp32, no autocast, no recomputation (its defaults are bf16=True and
# gradient_checkpointing=True); TRL_DEFAULTS keeps those two at TRL's defaults (reference only)
TRL_MATCHED = dict(bf16=False, gradient_checkpointing=False)
TRL_DEFAULTS: dict = {}


BENCH_ARGS = dict(  # the same work as detrl's side: 8 prompts x 4 samples x 16 tokens, one step per batch
    per_device_train_batch_size=PROMPTS * SAMPLES,
    num_generations=SAMPLES,
    max_completion_length=NEW_TOKENS,
    beta=0.0,
    num_iterations=1,
    steps_per_generation=1,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    use_vllm=False,
    use_cpu=True,
    temperature=1.0,
    seed=0,
    shuffle_dataset=False,
)
QUIET_ARGS = dict(report_to="none", save_strategy="no", logging_steps=10_000, disable_tqdm=True)


def trl_args(out: Path, steps: int, numerics: dict):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), max_steps=steps, **BENCH_ARGS, **QUIET_ARGS, **numerics)


def non_default_args(numerics: dict) -> dict:
    """The work and numerics arguments this benchmark gives GRPOConfig that differ from TRL's declared
    defaults (instantiating GRPOConfig() on a CPU fails: its bf16=True default needs a GPU)."""
    import dataclasses

    from trl import GRPOConfig

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    defaults = {f.name: default(f) for f in dataclasses.fields(GRPOConfig) if f.init}
    given = {**BENCH_ARGS, **numerics}
    return {k: v for k, v in given.items() if defaults.get(k, object()) != v}


def trl_steps(steps: int, out: Path, numerics: dict) -> dict[str, list[float]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    answers = {p.prompt: p.answer for p in (task[i] for i in range(len(task)))}
    data = Dataset.from_list([{"prompt": task[i % len(task)].prompt} for i in range(PROMPTS * steps)])

    def reward(prompts, completions, **kwargs):
        return [exact_match_reward(c, answers[p]) for p, c in zip(prompts, completions)]

    times: dict[str, list[float]] = {"step": [], "rollout": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times["step"].append(time.perf_counter() - self.t0)

    args = trl_args(out, steps, numerics)
    model = build_model(ModelConfig(), seed=0)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Timer()],
    )
    generate_and_score = trainer._generate_and_score_completions  # TRL's rollout + reward, once a step here

    def timed_rollout(*a, **kw):
        t0 = time.perf_counter()
        out = generate_and_score(*a, **kw)
        times["rollout"].append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_rollout
    trainer.train()
    return {k: v[WARMUP:] for k, v in times.items()}


def rows(threads: int) -> dict[str, tuple]:
    """The table's rows: name -> (key, intra-op threads (None: the process's), run(steps, out) -> seconds per step
    of the whole step and of its rollout, {"step": [...], "rollout": [...]}).
    TRL's matched row runs at the process's threads and at one: on 2 cores its `generate` and update are faster at
    one (many small ops); ratios are taken against the faster matched row (a peer at its best). detrl's rows run
    as `python train.py` does (the process's threads), plus `off` at one thread."""
    return {
        f"detrl, determinism=off ({threads} threads)": ("detrl_off", None, partial(detrl_steps, "off")),
        f"detrl, determinism=on ({threads} threads)": ("detrl_on", None, partial(detrl_steps, "on")),
        "detrl, determinism=off (1 thread)": ("detrl_off_1thread", 1, partial(detrl_steps, "off")),
        f"TRL GRPOTrainer, same numerics ({threads} threads)": (
            "trl_matched", None, partial(trl_steps, numerics=TRL_MATCHED),
        ),
        "TRL GRPOTrainer, same numerics (1 thread)": (
            "trl_matched_1thread", 1, partial(trl_steps, numerics=TRL_MATCHED),
        ),
        f"TRL GRPOTrainer, its defaults ({threads} threads; bf16=True autocast, gradient_checkpointing=True): "
        "reference only": ("trl_defaults", None, partial(trl_steps, numerics=TRL_DEFAULTS)),
    }  # fmt: skip


MATCHED = ("trl_matched", "trl_matched_1thread")  # TRL at the same numerics; the faster is the reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--json",
        type=Path,
        help="also write the figures here (step_s, vs_trl, per_round, trl_best, rollout_s, settings)",
    )
    args = ap.parse_args()
    register_configs()
    table = rows(torch.get_num_threads())
    times: dict[str, list[float]] = {key: [] for key, _, _ in table.values()}
    rollout: dict[str, list[float]] = {key: [] for key, _, _ in table.values()}
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this = {}
            for key, threads, run in table.values():
                with intra_op_threads(threads):
                    got = run(args.steps, Path(tmp) / f"{key}{r}")
                this[key] = got["step"]
                times[key] += got["step"]
                rollout[key] += got["rollout"]
            per_round.append({k: statistics.median(v) for k, v in this.items()})
    shown = non_default_args(TRL_MATCHED)
    print(
        f"\nTRL {__import__('trl').__version__} GRPOConfig arguments that differ from its defaults (matched rows): "
        + ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items()))
    )
    figures = summarize(times, per_round)
    figures["rollout_s"] = {k: statistics.median(v) for k, v in rollout.items()}
    print(
        f"\n{PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens, GRPO, no reference model, CPU, fp32; "
        f"median of {args.rounds} x {args.steps - WARMUP} steps; ratios against {figures['trl_best']} "
        "(the faster TRL row at the same numerics)\n"
    )
    print(
        "| trainer | median step (s) | vs TRL at its best (same numerics) | per round | rollout + reward (s) |"
        "\n|---|---|---|---|---|"
    )
    for name, (key, _, _) in table.items():
        rounds = ", ".join(f"{pr[key]:.2f}x" for pr in figures["per_round"])
        step, roll = figures["step_s"][key], figures["rollout_s"][key]
        print(f"| {name} | {step:.3f} | {figures['vs_trl'][key]:.2f}x | {rounds} | {roll:.3f} |")
    print(
        "\nrollout + reward: detrl's timing_s/rollout, TRL's _generate_and_score_completions (medians per step); "
        "the rest of a step is the update (and detrl's weight sync and per-step metrics)"
    )
    if args.json:
        workload = dict(prompts=PROMPTS, samples=SAMPLES, max_new_tokens=NEW_TOKENS, warmup_steps=WARMUP)
        figures.update(
            workload=workload,
            trl_args_not_default={k: repr(v) for k, v in shown.items()},
            threads=torch.get_num_threads(),
        )
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def summarize(times: dict[str, list[float]], per_round: list[dict[str, float]]) -> dict:
    """Median step seconds per row; each row / the faster matched TRL row (overall, and per round against that
    round's faster matched row)."""
    step_s = {k: statistics.median(v) for k, v in times.items()}
    best = min(MATCHED, key=step_s.__getitem__)
    return {
        "step_s": step_s,
        "trl_best": best,
        "vs_trl": {k: v / step_s[best] for k, v in step_s.items()},
        "per_round": [{k: v / min(pr[m] for m in MATCHED) for k, v in pr.items()} for pr in per_round],
    }


if __name__ == "__main__":
    main()
