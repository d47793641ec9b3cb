"""detrl on one GPU, in sections (one subcommand each; on the GPU machine through `bash scripts/gpu_run.sh`):

    python benchmarks/gpu.py bench [--out DIR] [--sections targets,...]   # the default: gpu.py --sections ...
    python benchmarks/gpu.py profile [--batch 64] [--model qwen3_0p6b]
    python benchmarks/gpu.py profile16 [--model qwen3_0p6b] [--batch 64] [--modes on,off] [--no-profile]
    python benchmarks/gpu.py paged [--model qwen3_0p6b] [--batch 32] [--new 64] [--json out.json]
    python benchmarks/gpu.py kernels [--out results.json]
    python benchmarks/gpu.py tiles [--out tiles.json]

`python benchmarks/gpu.py SECTION --help` describes each.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

# detrl, Hydra and transformers are imported where a section uses them: `--help` needs torch alone
if TYPE_CHECKING:
    from detrl.config import ModelConfig

BENCH = """The CUDA engine vs transformers `generate`, the trainer step, and one GRPO step vs TRL.

Models: Qwen3-0.6B's shape (conf/model/qwen3_0p6b.yaml) and Qwen3-30B-A3B's layer shape with 6 layers
(conf/model/qwen3_moe_a3b_6l.yaml), random init, bf16 compute (float32 master weights in the trainer).
- rollout: 256 new tokens per sequence (no stop token), batch 64 and 256, prompts of the arithmetic task;
  the engine (determinism off: unseeded sampling, torch kernels, CUDA-graph decode) vs
  `model.generate(do_sample=True, top_k=0, top_p=1.0)` on a bf16 copy, same process, same prompts.
- grpo: detrl's `train()` on 8 prompts x 8 samples x 256 new tokens (GRPO, no reference model, one optimizer
  step per batch, determinism off; `algo.old_logprobs=current`: the old logprobs from the gradient pass, as TRL
  at num_iterations=1); per-step times from its metrics (rollout, update, params fingerprint).
- generate: `generate` alone at batch 64, first in its process (the control for the side-by-side rows; both
  run under torch's default flags, not detrl's determinism flags).
- generate_variants: `generate` under each of its settings (cache, compile, autocast), first in its process.
- onoff: determinism on vs off side by side, like with like: the engine (on: the batch-invariant Triton op set,
  fixed routing, per-sample seeds, CUDA graphs; off: torch's kernels compiled, dynamic routing, unseeded) on
  both shapes, and `train()`'s GRPO step on the 0.6B shape under each mode. grpo_onoff: its GRPO steps only.
- engine: the engine alone on both shapes. grpo_moe: the GRPO step on the MoE shape.
- trl: TRL 1.16 GRPOTrainer on the same work (use_vllm=False, bf16, no gradient checkpointing, beta 0).
- targets: in one command: TRL's step first, in a fresh process under torch's default flags (`trl_fresh`),
  then side by side in this one: the 0.6B engine (off) vs generate at batch 64, the engines on vs off (0.6B at
  64 and 256, MoE at 64), the GRPO step off and on (0.6B, and the MoE shape's first 2 layers).
  vs_trl: TRL's step (fresh process) and the 0.6B GRPO step off and on only.
Writes results.json and table.md into --out and prints the table last.
"""

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
DENSE, MOE = "qwen3_0p6b", "qwen3_moe_a3b_6l"
PROMPTS, SAMPLES, NEW = 8, 8, 256
RESULTS: dict = {}
# TRL's work at num_iterations=1: the old logprobs are the gradient pass's own (no separate no-grad pass)
OLD_LOGPROBS = "current"


def model_cfg(name: str) -> ModelConfig:
    from hydra import compose, initialize_config_dir

    from detrl.config import to_typed

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_typed(compose("train", overrides=[f"model={name}", "logger=none"])).model


def random_model(name: str):
    """The shape, random init on the GPU (fast), float32."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from detrl.models.build import hf_config

    cfg = model_cfg(name)
    cls = Qwen3ForCausalLM if cfg.name == "qwen3" else Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(hf_config(cfg)).float().eval()


def prompts(batch: int) -> list[list[int]]:
    """Arithmetic prompts of one length (single-digit operands), repeated to `batch`."""
    from detrl.data import ArithmeticTask, build_tokenizer
    from detrl.warmstart import encode

    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    ids = [encode(tok, task[i].prompt) for i in range(len(task))]
    ids = [x for x in ids if len(x) == len(ids[0])]
    return [ids[i % len(ids)] for i in range(batch)]


def timed(fn, repeats: int = 1) -> float:
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@contextlib.contextmanager
def torch_defaults():
    """torch's own global flags (as a fresh process has them) for a peer's code: `generate` must not run under
    detrl's determinism flags (cudnn.benchmark autotunes every new shape, and generate's cache grows each step)."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, False
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        (
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
        ) = saved[1:]


def generate_tok_s(hf, b: int, tokens: int) -> tuple[float, float, float]:
    """transformers `generate(do_sample=True)` on b prompts x `tokens` new tokens, under torch's default flags:
    -> (tok/s, seconds, peak GiB)."""
    ids = torch.tensor(prompts(b), device="cuda")
    kw = dict(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch_defaults():
        hf.generate(
            ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        torch.cuda.reset_peak_memory_stats()
        s = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), **kw))
    return b * tokens / s, s, torch.cuda.max_memory_allocated() / 2**30


def generate_section(name: str, batches: list[int], tokens: int) -> None:
    """`generate` alone, first thing in a fresh process: the control for the side-by-side rollout rows."""
    hf = random_model(name).to(torch.bfloat16)
    for b in batches:
        tps, s, mem = generate_tok_s(hf, b, tokens)
        RESULTS[f"generate/{name}/b{b}"] = dict(
            generate_s=s, generate_tok_s=tps, generate_new_tokens=tokens, generate_peak_gib=mem
        )
        print(f"generate alone {name} b={b}: {tps:,.0f} tok/s ({s:.2f} s for {tokens} tokens)", flush=True)


def generate_variants_section(name: str, b: int, tokens: int) -> None:
    """Why `generate`'s figure moved (2,242 vs 728-858 tok/s on one code path): the same b x tokens sampled
    decode under each setting, three timed calls each after one warm-up, first thing in a fresh process.
    bench: the rollout rows' call (bf16 model, DynamicCache, min_new_tokens); no_compile: + disable_compile
    (TRL's GenerationConfig sets it); trl: TRL 1.16's call (fp32 model under bf16 autocast, no min_new_tokens,
    disable_compile); static: a static cache (transformers compiles its decode step)."""
    from transformers import GenerationConfig

    hf32 = random_model(name)
    hf16 = random_model(name).to(torch.bfloat16)
    ids = torch.tensor(prompts(b), device="cuda")
    base = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=tokens, pad_token_id=0)
    variants = {
        "bench": (hf16, dict(base, min_new_tokens=tokens, eos_token_id=None), False),
        "no_compile": (
            hf16,
            dict(base, min_new_tokens=tokens, eos_token_id=None, disable_compile=True),
            False,
        ),
        "trl": (hf32, dict(base, eos_token_id=None, disable_compile=True), True),
        "static": (
            hf16,
            dict(base, min_new_tokens=tokens, eos_token_id=None, cache_implementation="static"),
            False,
        ),
    }
    for tag, (hf, kw, autocast) in variants.items():
        cfg = GenerationConfig(**kw)
        amp = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()

        def call(hf=hf, cfg=cfg, amp=amp):
            with amp, torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

        try:
            with torch_defaults():
                t0 = time.perf_counter()
                out = call()
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                times = [timed(call) for _ in range(2)]
            new = out.shape[1] - ids.shape[1]
            RESULTS[f"generate_variants/{name}/b{b}/{tag}"] = dict(
                warmup_s=warm, times_s=times, new_tokens=new, tok_s=b * new / statistics.median(times)
            )
            print(
                f"generate {tag} {name} b={b}: warm-up {warm:.2f} s, then "
                + ", ".join(f"{t:.2f}" for t in times)
                + f" s for {new} tokens -> {b * new / statistics.median(times):,.0f} tok/s",
                flush=True,
            )
        except Exception as e:  # one variant failing (e.g. compile) must not hide the others
            print(f"generate {tag}: failed: {type(e).__name__}: {e}", flush=True)
            RESULTS[f"generate_variants/{name}/b{b}/{tag}"] = dict(error=f"{type(e).__name__}: {e}")


def rollout_section(name: str, batches: list[int], hf_tokens: int, determinism: str = "off") -> None:
    """hf_tokens 0: the engine alone. determinism on: the batch-invariant op set, fixed routing and per-sample
    seeds (as `train()` runs the engine under on); off: torch's kernels, dynamic routing, unseeded."""
    from detrl import determinism as det_mod
    from detrl import runtime
    from detrl.models.forward import rope_tables  # noqa: F401
    from detrl.rollout import SamplingParams
    from detrl.rollout.base import Request
    from detrl.rollout.cuda import CudaEngine

    model = random_model(name)
    ctx = -(-(len(prompts(1)[0]) + NEW) // 8) * 8
    det = det_mod.setup(determinism == "on", 0)
    rt = runtime.make(det, "cuda", torch.bfloat16)
    engine = CudaEngine(
        model,
        rt.ops,
        ctx,
        SamplingParams(1.0, 1.0, NEW, ()),
        seed=0,
        max_batch_size=max(batches),
        fixed_routing=det.fixed_routing,
        compile=rt.compile,
    )
    tag = "" if determinism == "off" else "/on"
    hf = model.to(torch.bfloat16)  # the engine holds its own bf16 copy; generate runs on the bf16 model
    del model
    for b in batches:
        reqs = [
            Request(i // 8, i % 8, tuple(p), seed=det.sampling_seed(1, i // 8, i % 8))
            for i, p in enumerate(prompts(b))
        ]
        t0 = time.perf_counter()
        first = engine.generate(reqs)  # captures this bucket's graph
        capture_s = time.perf_counter() - t0
        assert all(len(r.tokens) == NEW for r in first)
        torch.cuda.reset_peak_memory_stats()
        eng_s = timed(lambda reqs=reqs: engine.generate(reqs), repeats=3)
        eng_mem = torch.cuda.max_memory_allocated() / 2**30
        RESULTS[f"engine/{name}/b{b}{tag}"] = dict(
            engine_s=eng_s,
            engine_tok_s=b * NEW / eng_s,
            engine_first_call_s=capture_s,
            engine_peak_gib=eng_mem,
        )
        print(
            f"engine {name} b={b} determinism={determinism}: {b * NEW / eng_s:,.0f} tok/s ({eng_s:.3f} s; first call {capture_s:.2f} s), "
            f"peak {eng_mem:.1f} GiB",
            flush=True,
        )
        if not hf_tokens:
            continue
        hf_tps, hf_s, hf_mem = generate_tok_s(hf, b, hf_tokens)
        eng_tps = b * NEW / eng_s
        RESULTS[f"rollout/{name}/b{b}"] = dict(
            engine_s=eng_s,
            engine_tok_s=eng_tps,
            engine_first_call_s=capture_s,
            engine_peak_gib=eng_mem,
            generate_s=hf_s,
            generate_tok_s=hf_tps,
            generate_new_tokens=hf_tokens,
            generate_peak_gib=hf_mem,
            speedup=eng_tps / hf_tps,
        )
        print(
            f"rollout {name} b={b}: engine {eng_tps:,.0f} tok/s ({eng_s:.2f} s), generate {hf_tps:,.0f} tok/s "
            f"({hf_s:.2f} s for {hf_tokens} tokens) -> {eng_tps / hf_tps:.1f}x",
            flush=True,
        )
    engine.close()


def grpo_section(
    name: str, steps: int, out: Path, determinism: str = "off", layers: int | None = None
) -> None:
    """layers: the model's first `layers` layers only (the MoE shape's whole trainer state needs ~60 GiB)."""
    from hydra import compose, initialize_config_dir

    from detrl.config import to_typed
    from detrl.trainer import train

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_typed(
            compose(
                "train",
                overrides=[
                    f"model={name}",
                    "device=cuda",
                    f"determinism={determinism}",
                    f"steps={steps}",
                    f"train_batch_size={PROMPTS}",
                    f"rollout.n={SAMPLES}",
                    f"rollout.max_new_tokens={NEW}",
                    "rollout.max_batch_size=256",
                    "algo.use_kl_loss=false",
                    "seed=0",
                    f"micro_batch_size={PROMPTS * SAMPLES}",
                    "logger=none",
                    "checkpoint.save_final=false",
                    "lr=1e-6",
                    f"algo.old_logprobs={OLD_LOGPROBS}",
                    *([f"model.num_hidden_layers={layers}"] if layers else []),
                ],
            )
        )
    torch.cuda.reset_peak_memory_stats()
    name = f"{name}_{layers}l" if layers else name
    run = out / f"grpo_{name}_{determinism}"
    if (
        run.exists()
    ):  # sections that repeat a run (targets with grpo_onoff, say): each keeps its own directory
        run = Path(tempfile.mkdtemp(prefix=run.name + "_", dir=out))
    train(cfg, run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    peak = torch.cuda.max_memory_allocated() / 2**30
    # the params fingerprint (a host copy + xxhash of the float32 weights) is inside timing_s/step: time it apart
    from detrl.fingerprint import params_digest
    from detrl.models.build import build_model

    fp_s = _fingerprint_time(build_model(cfg.model, seed=0).cuda(), params_digest)
    later = rows[1:]  # step 1 captures the graphs and warms the allocator
    step = statistics.median(r["timing_s/step"] for r in later)
    roll = statistics.median(r["timing_s/rollout"] for r in later)
    RESULTS[f"grpo/{name}/{determinism}"] = dict(
        step_s=step,
        rollout_s=roll,
        update_and_sync_s=step - roll - fp_s,
        params_fingerprint_s=fp_s,
        step_without_fingerprint_s=step - fp_s,
        first_step_s=rows[0]["timing_s/step"],
        peak_gib=peak,
        steps=[r["timing_s/step"] for r in rows],
        reward=[r["critic/score/mean"] for r in rows],
    )
    print(
        f"grpo {name}: step {step:.3f} s (rollout {roll:.3f}, fingerprint {fp_s:.3f}), peak {peak:.1f} GiB",
        flush=True,
    )
    torch.cuda.empty_cache()


def _fingerprint_time(model, params_digest) -> float:
    return timed(lambda: params_digest(model), repeats=3)


def trl_section(name: str, steps: int, out: Path) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from detrl.data import ArithmeticTask, build_tokenizer, exact_match_reward

    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    answers = {task[i].prompt: task[i].answer for i in range(len(task))}
    data = Dataset.from_list([{"prompt": task[i % len(task)].prompt} for i in range(PROMPTS * (steps + 1))])

    def reward(prompts, completions, **kwargs):
        return [exact_match_reward(c, answers[p]) for p, c in zip(prompts, completions)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    kw = dict(
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=NEW,
        beta=0.0,
        num_iterations=1,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        learning_rate=1e-6,
        max_steps=steps,
        use_vllm=False,
        bf16=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        shuffle_dataset=False,
        temperature=1.0,
        seed=0,
        top_k=0,
        top_p=1.0,
    )
    args = GRPOConfig(output_dir=str(out / "trl"), **kw)
    defaults = GRPOConfig(output_dir=str(out / "trl"))
    diff = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(GRPOConfig)
        if f.name != "output_dir" and repr(getattr(args, f.name)) != repr(getattr(defaults, f.name))
    }
    print("TRL GRPOConfig args that differ from its defaults:", diff, flush=True)
    import trl

    torch.manual_seed(0)
    model = random_model(name).train()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Timer()],
    )
    torch.cuda.reset_peak_memory_stats()
    with torch_defaults():
        trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30
    RESULTS[f"trl/{name}"] = dict(
        step_s=statistics.median(times[1:]),
        steps=times,
        peak_gib=peak,
        version=trl.__version__,
        args_not_default={k: repr(v) for k, v in diff.items()},
    )
    print(f"trl {name}: step {statistics.median(times[1:]):.3f} s, peak {peak:.1f} GiB", flush=True)
    trainer.model = None


def trl_fresh(out: Path) -> None:
    """TRL's step in a fresh process first: nothing of detrl's (torch's determinism flags, the cuBLAS workspace
    config it sets under `on`, compiled kernels, the allocator) has touched the process TRL is timed in."""
    import subprocess

    sub = out / "trl_fresh"
    subprocess.run([sys.executable, __file__, "bench", "--sections", "trl", "--out", str(sub)], check=True)
    RESULTS.update(json.loads((sub / "results.json").read_text()))


def table() -> str:
    dev = torch.cuda.get_device_name()
    lines = [f"{dev}, torch {torch.__version__}, {datetime.date.today().isoformat()}", ""]
    lines += [
        "| rollout (256 new tokens/seq) | batch | detrl engine tok/s | generate tok/s | vs generate | "
        "engine peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in RESULTS.items():
        if k.startswith("rollout/"):
            _, name, b = k.split("/")
            note = "" if v["generate_new_tokens"] == NEW else f" ({v['generate_new_tokens']} tokens)"
            lines.append(
                f"| {name} | {b[1:]} | {v['engine_tok_s']:,.0f} | {v['generate_tok_s']:,.0f}{note} | "
                f"{v['speedup']:.1f}x | {v['engine_peak_gib']:.1f} |"
            )
    lines += [
        "",
        f"| GRPO step, {PROMPTS} prompts x {SAMPLES} samples x {NEW} tokens | step (s) | rollout (s) | "
        "update + sync (s) | params fingerprint (s) | step w/o fingerprint (s) | vs TRL | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, v in RESULTS.items():
        if k.startswith("grpo/"):
            _, name, det = k.split("/")
            trl = RESULTS.get(f"trl/{name}")
            vs = (
                f"{v['step_s'] / trl['step_s']:.3f}x ({v['step_without_fingerprint_s'] / trl['step_s']:.3f}x)"
                if trl
                else "-"
            )
            lines.append(
                f"| detrl {name} determinism={det} | {v['step_s']:.3f} | {v['rollout_s']:.3f} | "
                f"{v['update_and_sync_s']:.3f} | {v['params_fingerprint_s']:.3f} | "
                f"{v['step_without_fingerprint_s']:.3f} | {vs} | {v['peak_gib']:.1f} |"
            )
    onoff = [
        (k, v, RESULTS[k + "/on"])
        for k, v in RESULTS.items()
        if k.startswith("engine/") and k + "/on" in RESULTS
    ]
    if onoff:
        lines += [
            "",
            "| engine decode (256 new tokens/seq) | batch | off tok/s | on tok/s | on/off time |",
            "|---|---|---|---|---|",
        ]
        for k, off, on in onoff:
            _, name, b = k.split("/")
            lines.append(
                f"| {name} | {b[1:]} | {off['engine_tok_s']:,.0f} | {on['engine_tok_s']:,.0f} | "
                f"{off['engine_tok_s'] / on['engine_tok_s']:.2f}x |"
            )
    for name in dict.fromkeys(k.split("/")[1] for k in RESULTS if k.startswith("grpo/")):
        on, off = RESULTS.get(f"grpo/{name}/on"), RESULTS.get(f"grpo/{name}/off")
        if on and off:
            lines.append(
                f"\nGRPO step {name}: on/off = {on['step_s'] / off['step_s']:.2f}x (rollout "
                f"{on['rollout_s'] / off['rollout_s']:.2f}x, step w/o fingerprint "
                f"{on['step_without_fingerprint_s'] / off['step_without_fingerprint_s']:.2f}x)"
            )
    for k, v in RESULTS.items():
        if k.startswith("trl/"):
            lines.append(
                f"| TRL {v['version']} GRPOTrainer {k.split('/')[1]} | {v['step_s']:.3f} | - | - | - | - | "
                f"1.00x | {v['peak_gib']:.1f} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ profile, profile16

PROFILE = """Where a decode step's time goes: the CUDA engine's step (determinism off's op set, compiled stages)
with and without CUDA graphs, then the top kernels by device time of the graph-less engine under
torch.profiler."""

PROFILE16 = """Where determinism=on's time goes on one GPU, against off, for the engine's decode and the trainer's
logprob forward + backward (the two halves of a GRPO step), each under its mode's torch flags
(determinism.setup). Per mode: ms per decode step (CUDA graphs, seeded requests under on as the trainer sends
them), ms of one sequence_logprobs forward + backward on batch x ctx tokens, and the top kernels of each by device
time."""


def top_kernels(prof, rows: int = 18, width: int = 60) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=width)


def decode_engine(model, ops, batch: int, fixed_routing: bool, **kw):
    """A CUDA engine for batch prompts x NEW tokens at temperature 1, and its context length."""
    from detrl.rollout.base import SamplingParams
    from detrl.rollout.cuda import CudaEngine

    ctx = -(-(len(prompts(1)[0]) + NEW) // 8) * 8
    params = SamplingParams(1.0, 1.0, NEW, ())
    engine = CudaEngine(
        model, ops, ctx, params, seed=0, max_batch_size=batch, fixed_routing=fixed_routing, **kw
    )
    return engine, ctx


def profile(args: argparse.Namespace) -> None:
    from detrl.models.ops import CUDA_DEFAULT_OPS
    from detrl.rollout.base import Request

    model = random_model(args.model)
    ops = dataclasses.replace(CUDA_DEFAULT_OPS, dtype=torch.bfloat16)
    reqs = [Request(i // 8, i % 8, tuple(p)) for i, p in enumerate(prompts(args.batch))]
    for graphs in (True, False):
        eng, _ = decode_engine(model, ops, args.batch, False, graphs=graphs, compile=True)
        eng.generate(reqs)  # warm: captures the graphs
        step_ms = timed(lambda eng=eng: eng.generate(reqs)) / NEW * 1e3
        print(f"graphs={graphs}: {step_ms:.3f} ms per decode step (batch {args.batch})", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.generate(reqs[: args.batch])
        torch.cuda.synchronize()
    print(top_kernels(prof, 25, 70))


def profiled(fn, enabled: bool) -> None:
    """fn() once under torch.profiler (CUDA activity), then its top kernels."""
    if enabled:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(top_kernels(prof), flush=True)


def mode_requests(mode: str, batch: int, n: int):
    """A mode's determinism flags (set now) and GPU runtime, and `batch` requests in groups of n, seeded under on
    as the trainer sends them. -> (det, rt, requests)."""
    from detrl import determinism as det_mod
    from detrl import runtime
    from detrl.rollout.base import Request

    det = det_mod.setup(mode == "on", 0)
    rt = runtime.make(det, "cuda", torch.bfloat16)
    reqs = [
        Request(i // n, i % n, tuple(p), seed=det.sampling_seed(1, i // n, i % n))
        for i, p in enumerate(prompts(batch))
    ]
    return det, rt, reqs


def profile16(args: argparse.Namespace) -> None:
    from detrl.models.forward import rope_tables
    from detrl.models.logprobs import sequence_logprobs

    model = random_model(args.model)
    for mode in args.modes.split(","):
        det, rt, reqs = mode_requests(mode, args.batch, 8)
        eng, ctx = decode_engine(
            model, rt.ops, args.batch, det.fixed_routing, dtype=torch.bfloat16, compile=rt.compile
        )
        eng.generate(reqs)  # warm: captures the graphs
        step_ms = timed(lambda eng=eng, reqs=reqs: eng.generate(reqs)) / NEW * 1e3
        print(
            f"[{mode}] {rt.ops.name}: {step_ms:.3f} ms per decode step (batch {args.batch}, graphs)",
            flush=True,
        )
        profiled(lambda eng=eng, reqs=reqs: eng.generate(reqs), not args.no_profile)
        eng.close()
        del eng
        rope = rope_tables(model.config, ctx, "cuda", torch.bfloat16)
        ids = torch.randint(3, 1000, (args.batch, ctx), device="cuda")
        mask = torch.zeros(args.batch, ctx - 1, device="cuda")
        mask[:, len(prompts(1)[0]) - 1 :] = 1

        def fwd_bwd(ids=ids, mask=mask, ops=rt.ops, rope=rope, ctx=ctx):
            tok, ent = sequence_logprobs(model, ids, mask, ops, ctx, rope, 1.0, entropy=True)
            (tok.sum() + 0.01 * ent.sum()).backward()
            model.zero_grad(set_to_none=True)

        fwd_bwd()  # warm
        print(
            f"[{mode}] trainer logprobs fwd+bwd {args.batch}x{ctx}: {timed(fwd_bwd) * 1e3:.1f} ms", flush=True
        )
        profiled(fwd_bwd, not args.no_profile)
        torch.cuda.empty_cache()


PAGED = """The paged engine core on one GPU (what `train.py device=cuda` runs): `CudaPagedEngine.generate` on
batch prompts x up to --new tokens (seeded requests under on, as the trainer sends them), per mode with its op set
and torch flags, side by side in one run: its decode steps as CUDA graphs with the host one step ahead (the
default, `cuda_overlap`), as graphs with a host sync every step, and eager. With
--stops N the first N token ids stop a sequence (a random-init model samples near uniformly, so lengths spread and
the batch shrinks, the padded buckets' case); with 0 (the default) every step decodes the whole batch. Reported:
ms per decode step (the call's time / the longest response) and tokens per second. --profile adds the top ops by
host and by device time of one call. JSON (--json): ms_per_decode_step.{on,off}, tokens_per_s.{on,off} (the
default) and the same under *_no_overlap and *_eager."""


# (JSON key suffix, CUDA graphs, host one step ahead): the default, then without the overlap, then eager
PAGED_VARIANTS = (("", True, True), ("_no_overlap", True, False), ("_eager", False, False))


def paged(args: argparse.Namespace) -> None:
    from detrl.rollout.base import SamplingParams
    from detrl.rollout.cuda_paged import CudaPagedEngine

    model, out = random_model(args.model), {}
    ctx = -(-(len(prompts(1)[0]) + args.new) // 16) * 16
    params = SamplingParams(1.0, 1.0, args.new, tuple(range(args.stops)))
    for mode in args.modes.split(","):
        det, rt, reqs = mode_requests(mode, args.batch, 4)
        for suffix, graphs, overlap in PAGED_VARIANTS:
            eng = CudaPagedEngine(
                model, rt.ops, ctx, params, 0, args.batch, det.fixed_routing, graphs=graphs, overlap=overlap
            )
            eng.generate(reqs)  # warm: the Triton kernels compile, the graphs are captured
            got: list = []
            secs = timed(lambda eng=eng, reqs=reqs, got=got: got.append(eng.generate(reqs)), 2)
            tokens = sum(len(r.tokens) for r in got[-1])
            name = mode + suffix
            out[name] = dict(ms=secs / max(len(r.tokens) for r in got[-1]) * 1e3, tok_s=tokens / secs)
            print(
                f"[{name}] {rt.ops.name}: {out[name]['ms']:.2f} ms per decode step, {out[name]['tok_s']:.0f} "
                f"tokens/s ({tokens} tokens, batch {args.batch})",
                flush=True,
            )
            if args.timeline and not suffix:
                out[name]["timeline"] = timeline(eng, reqs)
                print(f"[{name}] timeline: {json.dumps(out[name]['timeline'])}", flush=True)
            if args.profile:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    eng.generate(reqs)
                    torch.cuda.synchronize()
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
            eng.close()
            del eng
            torch.cuda.empty_cache()
    if args.json:
        settings = dict(
            model=args.model, batch=args.batch, new_tokens=args.new, ctx_len=ctx, dtype="bfloat16",
            stop_ids=args.stops,
        )  # fmt: skip
        figures = {
            f"{key}{suffix}": {m: out[m + suffix][field] for m in args.modes.split(",")}
            for key, field in (("ms_per_decode_step", "ms"), ("tokens_per_s", "tok_s"))
            for suffix, _, _ in PAGED_VARIANTS
        }
        if args.timeline:
            figures["timeline"] = {m: out[m]["timeline"] for m in args.modes.split(",")}
        Path(args.json).write_text(json.dumps({**figures, "settings": settings}, indent=1))


def host_phases(eng, reqs) -> dict[str, float]:
    """One `generate` with the paged core's host phases timed (perf_counter, nested: `launch` holds `fill` and
    `replay`, `land` holds its wait for the device): seconds in each, and the call's decode steps."""
    from detrl.rollout.cuda_graphs import DecodeGraphs
    from detrl.rollout.cuda_overlap import OverlapCore
    from detrl.rollout.scheduler import EngineCore

    spent: dict[str, float] = {}
    targets = {  # phase: (class, method, which calls count)
        "step": (OverlapCore, "step", None), "launch": (OverlapCore, "_launch", None),
        "land": (OverlapCore, "_land", None), "land_wait": (torch.cuda.Event, "synchronize", None),
        "fill": (DecodeGraphs, "_fill", None), "replay": (torch.cuda.CUDAGraph, "replay", None),
        "plain_prefill": (EngineCore, "_run", False), "plain_decode": (EngineCore, "_run", True),
    }  # fmt: skip
    saved = {(c, m): c.__dict__.get(m) for c, m, _ in targets.values()}  # None: inherited

    def timer(fn, phases):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                key = (
                    phases[None]
                    if None in phases
                    else phases[a[-1] if "decoding" not in kw else kw["decoding"]]
                )
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        return wrapped

    by_method: dict = {}
    for phase, (c, m, which) in targets.items():
        by_method.setdefault((c, m), {})[which] = phase
    for (c, m), phases in by_method.items():
        setattr(c, m, timer(getattr(c, m), phases))
    try:
        steps0, piped0 = eng.core.steps, eng.core.pipelined
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = eng.generate(reqs)
        torch.cuda.synchronize()
        spent["wall"] = time.perf_counter() - t0
    finally:
        for (c, m), fn in saved.items():
            setattr(c, m, fn) if fn is not None else delattr(c, m)
    longest = max(len(r.tokens) for r in got)
    return {**spent, "longest": longest, "core_steps": eng.core.steps - steps0,
            "pipelined": eng.core.pipelined - piped0}  # fmt: skip


def device_busy(fn) -> dict[str, float]:
    """fn() under torch.profiler (CUDA activity): seconds the device ran anything (the union of its kernels' and
    copies' intervals), from its first to its last, and the call's wall time (with the profiler's overhead)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted(
        (e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events() if e.device_type() == cuda
    )
    busy, end = 0, None
    for a, b in spans:
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    first_last = (spans[-1][1] - spans[0][0]) * 1e-9 if spans else 0.0
    return {"busy": busy * 1e-9, "first_to_last": first_last, "wall_profiled": wall, "kernels": len(spans)}


def timeline(eng, reqs) -> dict[str, float]:
    """Where one `generate`'s time goes, per decode step (ms over the longest response): its wall time and host
    phases (no profiler), and the device's busy time (a second call, under the profiler)."""
    host = host_phases(eng, reqs)
    dev = device_busy(lambda: eng.generate(reqs))
    n = host.pop("longest")
    counts = {k: host.pop(k) for k in ("core_steps", "pipelined")}
    per_step = {f"{k}_ms": v / n * 1e3 for k, v in {**host, **{f"device_{k}": v for k, v in dev.items()}}.items()
                if k != "device_kernels"}  # fmt: skip
    return {**per_step, **counts, "longest": n, "device_spans": dev["kernels"]}


# ---------------------------------------------------------------------------------------------- kernels, tiles

KERNELS = """The batch-invariant Triton kernels against torch, bit for bit where they must agree with themselves,
and timed against torch's kernels on the models' real shapes. One line per check: max |diff| against torch's
kernel (float tolerance), and bitwise results for rows (a row alone / at another offset vs inside a large call),
phases (decode over the cache vs the causal training pass vs a prefill), backward run to run; then per-shape
times (CUDA events, median of 20) of the Triton gemm vs cuBLAS (F.linear) at decode (64 rows) and training
(64 x 272 rows) sizes; and whether cuBLAS and torch._grouped_mm happen to be row-invariant on these shapes (the
negative control)."""

TILES = """Does the invariant gemm's tiling change a row's bits, or only its chunking of K? And what does each
tiling cost against cuBLAS at decode (64 rows) and training (64 x 272 rows) sizes? For every gemm shape of the
two models the reference is `gemm` with the fixed tiles, unsplit, on 300 rows. Each tiling (BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages), unsplit and split-K (one program per K chunk, then an ordered sum), runs on the first 1,
7, 64 and 300 of those rows and inside a 17,408-row call, compared bitwise with the reference rows. Then times
(CUDA graphs, triton.testing.do_bench_cudagraph) of cuBLAS (F.linear), `gemm` as it launches itself
(`tiles_for`) and each tiling."""

# the gemm shapes (K, N) of the two models' layers
GEMM_SHAPES = {
    "0.6B qkv": (1024, 4096),
    "0.6B o": (2048, 1024),
    "0.6B gate_up": (1024, 6144),
    "0.6B down": (3072, 1024),
    "0.6B lm_head": (1024, 151936),
    "moe qkv": (2048, 5120),
    "moe o": (4096, 2048),
    "moe router": (2048, 128),
}
BIG = 64 * 272  # a training call's rows
CHECKS: dict = {}  # the kernels section's results, key -> value
BF = torch.bfloat16


def record(key, value):
    CHECKS[key] = value
    print(f"{key}: {value}", flush=True)


def cuda_ms(fn, n=20) -> float:
    fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rows_invariant(fn, k, total=320) -> str:
    x = torch.randn(total, k, device="cuda", dtype=BF)
    ref = fn(x)
    for m in (*range(1, 18), 31, 33, 64, 65, 128, 129, 256, 257, 300):
        for o in (0, 7):
            if not torch.equal(fn(x[o : o + m]), ref[o : o + m]):
                return f"VARIES at m={m} o={o}"
    big = torch.cat([x, torch.randn(64 * 272 - total, k, device="cuda", dtype=BF)])
    if not torch.equal(fn(big)[:total], ref):
        return "VARIES at m=17408"
    return "invariant"


def check_gemms(T) -> None:
    for name, (k, n) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=BF) * k**-0.5
        x = torch.randn(300, k, device="cuda", dtype=BF)
        d = (T.gemm(x, w).float() - F.linear(x, w).float()).abs().max().item()
        record(f"gemm {name} K={k} N={n}: max|triton - cublas|", d)
        record(f"gemm {name}: triton rows", rows_invariant(lambda a, w=w: T.gemm(a, w), k))
        record(f"gemm {name}: cublas rows", rows_invariant(lambda a, w=w: F.linear(a, w), k))
        for m in (64, 256, 64 * 272):
            a = torch.randn(m, k, device="cuda", dtype=BF)
            if n > 100000 and m > 256:
                continue
            record(
                f"gemm {name} M={m}: ms triton / cublas",
                (
                    round(cuda_ms(lambda a=a, w=w: T.gemm(a, w)), 4),
                    round(cuda_ms(lambda a=a, w=w: F.linear(a, w)), 4),
                ),
            )


def check_norms(T) -> None:
    from detrl.models.primitives import rms_norm

    x = torch.randn(64, 272, 1024, device="cuda", dtype=BF)
    w = torch.randn(1024, device="cuda", dtype=BF)
    record(
        "rms max|triton - torch|",
        (T.rms_norm(x, w, 1e-6).float() - rms_norm(x, w, 1e-6).float()).abs().max().item(),
    )
    flat = x.view(-1, 1024)
    record("rms triton rows", rows_invariant(lambda a: T.rms_norm(a, w, 1e-6), 1024))
    record("rms torch rows", rows_invariant(lambda a: rms_norm(a, w, 1e-6), 1024))
    qkv = torch.randn(8, 272, 32, 128, device="cuda", dtype=BF)
    wq = torch.randn(24, 128, device="cuda", dtype=BF)
    record(
        "rms heads slice max|diff|",
        (T.rms_norm(qkv[:, :, :24], wq, 1e-6).float() - rms_norm(qkv[:, :, :24], wq, 1e-6).float())
        .abs()
        .max()
        .item(),
    )
    record(
        "rms M=17408 ms triton / torch",
        (
            round(cuda_ms(lambda: T.rms_norm(flat, w, 1e-6)), 4),
            round(cuda_ms(lambda: rms_norm(flat, w, 1e-6)), 4),
        ),
    )
    lp = torch.randn(300, 151936, device="cuda", dtype=BF)
    f = lambda a: F.log_softmax(a.float(), -1)  # noqa: E731
    ref = f(lp)
    record(
        "log_softmax torch rows",
        all(
            torch.equal(f(lp[o : o + m]), ref[o : o + m]) for m in (1, 2, 5, 16, 17, 64, 100) for o in (0, 7)
        ),
    )


def check_attention(T) -> None:
    from detrl.models.ops import sdpa_attention

    for name, h, hkv in (("0.6B", 16, 8), ("moe", 32, 4)):
        b, length, d = 4, 272, 128
        q = torch.randn(b, h, length, d, device="cuda", dtype=BF)
        k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=BF) for _ in range(2))
        mask = (
            torch.arange(length, device="cuda")[None, None, None, :]
            <= torch.arange(length, device="cuda")[None, None, :, None]
        )
        train = T.attention(q, k, v, mask, d**-0.5)
        ref = sdpa_attention(q, k, v, mask, d**-0.5)
        record(f"attn {name} train max|triton - sdpa|", (train.float() - ref.float()).abs().max().item())
        bad = []
        for p in (0, 1, 5, 63, 64, 65, 127, 200, 271):
            m1 = torch.arange(length, device="cuda")[None, None, None, :] <= torch.full(
                (b, 1, 1, 1), p, device="cuda"
            )
            dec = T.attention(q[:, :, p : p + 1], k, v, m1, d**-0.5)
            if not torch.equal(dec[:, :, 0], train[:, :, p]):
                bad.append(p)
        record(f"attn {name} decode == training row (bitwise), failing positions", bad)
        pre = T.attention(q[:, :, :37], k, v, mask[:, :, :37], d**-0.5)
        record(f"attn {name} prefill(37) == training rows (bitwise)", torch.equal(pre, train[:, :, :37]))
        one = T.attention(q[1:2], k[1:2], v[1:2], mask, d**-0.5)
        record(f"attn {name} batch of 1 == row of batch 4 (bitwise)", torch.equal(one, train[1:2]))
        # backward vs sdpa's, and run to run
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        go = torch.randn_like(q)
        g1 = torch.autograd.grad(T.attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        g2 = torch.autograd.grad(T.attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        gr = torch.autograd.grad(sdpa_attention(qs, ks, vs, mask, d**-0.5), (qs, ks, vs), go)
        record(
            f"attn {name} backward max|triton - sdpa| (q, k, v)",
            [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
        )
        record(f"attn {name} backward run to run bitwise", all(torch.equal(a, b2) for a, b2 in zip(g1, g2)))
        big_q = torch.randn(64, h, length, d, device="cuda", dtype=BF)
        big_k, big_v = (torch.randn(64, hkv, length, d, device="cuda", dtype=BF) for _ in range(2))
        dq = big_q[:, :, :1]
        m1 = torch.arange(length, device="cuda")[None, None, None, :] <= torch.full(
            (64, 1, 1, 1), 200, device="cuda"
        )
        args = (big_q, big_k, big_v)
        record(
            f"attn {name} B=64 train ms triton / sdpa flash",
            (
                round(cuda_ms(lambda a=args, m=mask, s=d**-0.5: T.attention(*a, m, s)), 4),
                round(
                    cuda_ms(
                        lambda a=args: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True)
                    ),
                    4,
                ),
            ),
        )
        record(
            f"attn {name} B=64 decode ms triton",
            round(cuda_ms(lambda a=(dq, big_k, big_v, m1), s=d**-0.5: T.attention(*a, s)), 4),
        )


def check_moe(T) -> None:
    from detrl.models.ops import grouped_moe, route

    n, e, hdim, inter, k = 300, 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hdim, device="cuda", dtype=BF, generator=g)
    gu = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=BF, generator=g) * hdim**-0.5
    dn = torch.randn(e, hdim, inter, device="cuda", dtype=BF, generator=g) * inter**-0.5
    router = torch.randn(e, hdim, device="cuda", dtype=BF, generator=g) * hdim**-0.5

    def run(fn, a):
        tw, ti = route(T.linear(a, router), k, True)
        return fn(a, tw, ti, gu, dn, None, F.silu)

    ref = run(grouped_moe, x)
    mine = run(T.moe, x)
    record("moe max|triton - grouped_mm|", (mine.float() - ref.float()).abs().max().item())
    record("moe triton rows", rows_invariant(lambda a: run(T.moe, a), hdim))
    record("moe grouped_mm rows", rows_invariant(lambda a: run(grouped_moe, a), hdim))
    xs = x.detach().clone().requires_grad_()
    gus, dns = gu.clone().requires_grad_(), dn.clone().requires_grad_()
    go = torch.randn_like(x)
    tw, ti = route(T.linear(x, router), k, True)
    g1 = torch.autograd.grad(T.moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    g2 = torch.autograd.grad(T.moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    gr = torch.autograd.grad(grouped_moe(xs, tw, ti, gus, dns, None, F.silu), (xs, gus, dns), go)
    record(
        "moe backward max|triton - grouped_mm| (x, gate_up, down)",
        [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
    )
    record("moe backward run to run bitwise", all(torch.equal(a, b) for a, b in zip(g1, g2)))
    for m in (64, 64 * 272):
        a = torch.randn(m, hdim, device="cuda", dtype=BF)
        record(
            f"moe M={m} ms triton / grouped_mm",
            (
                round(cuda_ms(lambda a=a: run(T.moe, a)), 4),
                round(cuda_ms(lambda a=a: run(grouped_moe, a)), 4),
            ),
        )
    # graph capture of the whole block
    a = torch.randn(64, hdim, device="cuda", dtype=BF)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = run(T.moe, a)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(T.moe, a)
    graph.replay()
    record("moe graph replay == eager (bitwise)", torch.equal(captured, eager))


def check_linear_backward(T) -> None:
    x = torch.randn(64 * 272, 1024, device="cuda", dtype=BF, requires_grad=True)
    w = (torch.randn(4096, 1024, device="cuda", dtype=BF) * 0.03).requires_grad_()
    go = torch.randn(64 * 272, 4096, device="cuda", dtype=BF)
    g1 = torch.autograd.grad(T.linear(x, w), (x, w), go)
    g2 = torch.autograd.grad(T.linear(x, w), (x, w), go)
    gr = torch.autograd.grad(F.linear(x, w), (x, w), go)
    record(
        "linear backward max|triton - torch|",
        [(a.float() - r.float()).abs().max().item() for a, r in zip(g1, gr)],
    )
    record("linear backward run to run bitwise", all(torch.equal(a, b) for a, b in zip(g1, g2)))


def kernels(args: argparse.Namespace) -> None:
    os.environ.setdefault(
        "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
    )  # as determinism.setup(): before cuBLAS starts
    from detrl.models import triton_ops as T

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    record("device", torch.cuda.get_device_name())
    for check in (check_gemms, check_norms, check_attention, check_moe, check_linear_backward):
        try:
            check(T)
        except Exception as e:  # noqa: BLE001 - report and go on to the next check
            traceback.print_exc()
            record(f"{check.__name__} FAILED", repr(e)[:300])
    if args.out:
        Path(args.out).write_text(json.dumps(CHECKS, indent=1, default=str))


def tilings(T) -> list:
    """The launches the tiles section compares (Tiles(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages))."""
    return [
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


def tiling_name(t) -> str:
    return f"{t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}"


def graph_us(fn) -> float:
    import triton.testing

    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30)


def tiles_shape(T, k: int, n: int) -> dict:
    """One gemm shape: each tiling's bits against the fixed tiles', then the times of cuBLAS and each tiling."""
    w = torch.randn(n, k, device="cuda", dtype=BF) * k**-0.5
    x = torch.randn(BIG, k, device="cuda", dtype=BF)
    ref = T.gemm(x[:300], w, tiles=T.FIXED, split=False)
    cublas_err = (F.linear(x[:300], w).float() - ref.float()).abs().max().item()
    row: dict = {"K": k, "N": n, "max|fixed - cublas|": cublas_err, "bits": {}, "us": {}}
    for t in tilings(T):
        same = [
            torch.equal(T.gemm(x[:m], w, tiles=t, split=split), ref[:m])
            for split in (False, True)
            for m in (1, 7, 64, 300)
        ]
        if n < 100000:
            same.append(torch.equal(T.gemm(x, w, tiles=t, split=False)[:300], ref))
        row["bits"][tiling_name(t)] = all(same)
    for m, a in {64: x[:64], 256: x[:256], BIG: x}.items():
        if n > 100000 and m == BIG:
            continue
        times = {
            "cublas": graph_us(lambda a=a, w=w: F.linear(a, w)),
            "tiles_for": graph_us(lambda a=a, w=w: T.gemm(a, w)),
        }
        for t in tilings(T):
            if m > 256 and t.bm < 64:
                continue
            times[tiling_name(t)] = graph_us(lambda a=a, t=t, w=w: T.gemm(a, w, tiles=t))
        row["us"][m] = times
    return row


def tiles(args: argparse.Namespace) -> None:
    from detrl.models import triton_ops as T

    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    print(f"{res['device']}, torch {torch.__version__}; chunk_k(K) = min({T.CHUNK_K}, K)", flush=True)
    for label, (k, n) in GEMM_SHAPES.items():
        row = res["shapes"][label] = tiles_shape(T, k, n)
        print(f"\n== {label} K={k} N={n}: max|fixed - cublas| {row['max|fixed - cublas|']:.4g}", flush=True)
        print(
            "  same bits as the fixed tiles (unsplit and split, rows 1/7/64/300, inside 17408):",
            dict(row["bits"]),
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


# ---------------------------------------------------------------------------------------------- bench, main

BENCH_SECTIONS = (
    "targets",
    "vs_trl",
    "generate_variants",
    "generate",
    "grpo",
    "trl",
    "rollout",
    "engine",
    "onoff",
    "grpo_onoff",
    "grpo_moe",
)


def bench_jobs(sections: list[str], out: Path, args: argparse.Namespace) -> list:
    """The bench section's runs, in the order they go (the targets first: the GRPO step vs TRL, then the rollout
    tables). generate_variants runs at once: first in its process."""
    jobs = []
    if "targets" in sections:  # decode vs generate, on vs off, the step vs TRL, side by side
        jobs += [
            lambda: trl_fresh(out),
            lambda: rollout_section(DENSE, [64], NEW, "off"),
            lambda: rollout_section(DENSE, [256], 0, "off"),
            lambda: rollout_section(DENSE, [64, 256], 0, "on"),
            lambda: rollout_section(MOE, [64], 0, "off"),
            lambda: rollout_section(MOE, [64], 0, "on"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "off"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "on"),
            lambda: grpo_section(MOE, args.grpo_steps, out, "off", layers=2),
            lambda: grpo_section(MOE, args.grpo_steps, out, "on", layers=2),
        ]
    if "vs_trl" in sections:  # the GRPO step off and on against TRL's, TRL first in a fresh process
        jobs += [
            lambda: trl_fresh(out),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "off"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "on"),
        ]
    if "generate_variants" in sections:  # first in its process: what generate's figure depends on
        generate_variants_section(DENSE, 64, NEW)
    if "generate" in sections:  # the control: generate alone, before anything of detrl's runs in this process
        jobs += [lambda: generate_section(DENSE, [64], NEW)]
    if "grpo" in sections:
        jobs += [lambda: grpo_section(DENSE, args.grpo_steps, out)]
    if "trl" in sections:
        jobs += [lambda: trl_section(DENSE, 4, out)]
    if "rollout" in sections:
        jobs += [
            lambda: rollout_section(DENSE, [64, 256], NEW),
            lambda: rollout_section(MOE, [64, 256], args.hf_moe_tokens),
        ]
    if "engine" in sections:
        jobs += [lambda: rollout_section(DENSE, [64, 256], 0), lambda: rollout_section(MOE, [64, 256], 0)]
    if "onoff" in sections:  # determinism on vs off, like with like: engines, then GRPO steps
        jobs += [
            lambda: rollout_section(DENSE, [64, 256], 0, "off"),
            lambda: rollout_section(DENSE, [64, 256], 0, "on"),
            lambda: rollout_section(MOE, [64], 0, "off"),
            lambda: rollout_section(MOE, [64], 0, "on"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "off"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "on"),
        ]
    if "grpo_onoff" in sections:  # only the GRPO steps of onoff
        jobs += [
            lambda: grpo_section(DENSE, args.grpo_steps, out, "off"),
            lambda: grpo_section(DENSE, args.grpo_steps, out, "on"),
        ]
    if "grpo_moe" in sections:
        jobs += [lambda: grpo_section(MOE, 3, out)]
    return jobs


def bench(args: argparse.Namespace) -> None:
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    for job in bench_jobs(args.sections, out, args):
        try:
            job()
        except Exception:  # noqa: BLE001 - report and go on: one failing section must not lose the others
            traceback.print_exc()
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    t = table()
    (out / "table.md").write_text(t + "\n")
    print("\n" + t)


def section_list(text: str) -> list[str]:
    """--sections: comma-separated names of BENCH_SECTIONS."""
    names = text.split(",")
    bad = [s for s in names if s not in BENCH_SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(BENCH_SECTIONS)}")
    return names


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per section, each with its own arguments."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="section", required=True, metavar="{" + ",".join(SECTIONS) + "}")
    for name, (run, short, text) in SECTIONS.items():
        p = sub.add_parser(
            name,
            help=short,
            description=text,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run)
    bench_p, prof, prof16 = sub.choices["bench"], sub.choices["profile"], sub.choices["profile16"]
    bench_p.add_argument(
        "--out", default=None, help="directory for results.json and table.md (default: a temp dir)"
    )
    bench_p.add_argument(
        "--sections", type=section_list, default="rollout,grpo,trl", help=",".join(BENCH_SECTIONS)
    )
    bench_p.add_argument(
        "--hf-moe-tokens", type=int, default=32, help="generate's new tokens on the MoE (slow)"
    )
    bench_p.add_argument("--grpo-steps", type=int, default=5)
    for p in (prof, prof16):
        p.add_argument("--batch", type=int, default=64)
        p.add_argument("--model", default=DENSE)
    prof16.add_argument("--modes", default="on,off")
    prof16.add_argument("--no-profile", action="store_true")
    pag = sub.choices["paged"]
    pag.add_argument("--model", default=DENSE)
    pag.add_argument("--batch", type=int, default=32)
    pag.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    pag.add_argument("--modes", default="on,off")
    pag.add_argument("--stops", type=int, default=0, help="token ids 0..N-1 stop a sequence")
    pag.add_argument("--profile", action="store_true")
    pag.add_argument(
        "--timeline", action="store_true", help="the default's host phases and device busy time per step"
    )
    pag.add_argument("--json", default=None, help="write ms_per_decode_step, tokens_per_s here")
    for name in ("kernels", "tiles"):
        sub.choices[name].add_argument("--out", default=None, help="write the results here as JSON")
    return ap


SECTIONS = {  # name: (function, one-line help, description)
    "bench": (bench, "engine vs generate, GRPO step vs TRL, determinism on vs off", BENCH),
    "profile": (profile, "a decode step's time, with and without CUDA graphs, and its top kernels", PROFILE),
    "profile16": (
        profile16,
        "determinism on vs off: decode and the trainer's logprob pass, profiled",
        PROFILE16,
    ),
    "paged": (paged, "the paged engine core: decode steps as graphs vs eager, determinism on vs off", PAGED),
    "kernels": (kernels, "the Triton kernels vs torch: bitwise checks and times", KERNELS),
    "tiles": (tiles, "the invariant gemm's tilings: bits vs the fixed tiles, times vs cuBLAS", TILES),
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line; `gpu.py --sections ...` (no section named first) is the bench section's."""
    if argv and argv[0].startswith("--") and argv[0] != "--help":
        argv = ["bench", *argv]
    return parser().parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    from detrl.config import register_configs

    register_configs()
    args.run(args)


if __name__ == "__main__":
    main()
