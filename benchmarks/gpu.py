"""detrl on one GPU: the CUDA engine vs transformers `generate`, the trainer step, and one GRPO step vs TRL.

    python benchmarks/gpu.py [--out DIR] [--sections targets,vs_trl,generate_variants,generate,rollout,grpo,trl,engine,onoff,grpo_onoff,grpo_moe]
                             [--hf-moe-tokens 32]

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
- onoff (issue 16): determinism on vs off side by side, like with like: the engine (on: the batch-invariant
  Triton op set, fixed routing, per-sample seeds, CUDA graphs; off: torch's kernels compiled, dynamic routing,
  unseeded) on both shapes, and `train()`'s GRPO step on the 0.6B shape under each mode.
- trl: TRL 1.16 GRPOTrainer on the same work (use_vllm=False, bf16, no gradient checkpointing, beta 0).
- targets: what issues 15 and 16 measure, in one command: TRL's step first, in a fresh process under torch's
  default flags (`trl_fresh`), then side by side in this one: the 0.6B engine (off) vs generate at batch 64, the
  engines on vs off (0.6B at 64 and 256, MoE at 64), the GRPO step off and on (0.6B, and the MoE shape's first
  2 layers). vs_trl: TRL's step (fresh process) and the 0.6B GRPO step off and on only.
Writes results.json and table.md into --out and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from detrl.config import ModelConfig, register_configs, to_typed  # noqa: E402
from detrl.data import ArithmeticTask, build_tokenizer, exact_match_reward  # noqa: E402
from detrl.models.build import hf_config  # noqa: E402
from detrl.warmstart import encode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
DENSE, MOE = "qwen3_0p6b", "qwen3_moe_a3b_6l"
PROMPTS, SAMPLES, NEW = 8, 8, 256
RESULTS: dict = {}
# TRL's work at num_iterations=1: the old logprobs are the gradient pass's own (no separate no-grad pass)
OLD_LOGPROBS = "current"


def model_cfg(name: str) -> ModelConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_typed(compose("train", overrides=[f"model={name}", "logger=none"])).model


def random_model(name: str):
    """The shape, random init on the GPU (fast), float32."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cfg = model_cfg(name)
    cls = Qwen3ForCausalLM if cfg.name == "qwen3" else Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(hf_config(cfg)).float().eval()


def prompts(batch: int) -> list[list[int]]:
    """Arithmetic prompts of one length (single-digit operands), repeated to `batch`."""
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
    from detrl.models.forward import rope_tables  # noqa: F401
    from detrl.rollout import SamplingParams
    from detrl.rollout.base import Request
    from detrl.rollout.cuda import CudaEngine

    model = random_model(name)
    ctx = -(-(len(prompts(1)[0]) + NEW) // 8) * 8
    det = det_mod.setup(determinism == "on", 0, "cuda", torch.bfloat16)
    engine = CudaEngine(
        model,
        det.ops,
        ctx,
        SamplingParams(1.0, 1.0, NEW, ()),
        seed=0,
        max_batch_size=max(batches),
        fixed_routing=det.fixed_routing,
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
    subprocess.run([sys.executable, __file__, "--sections", "trl", "--out", str(sub)], check=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="rollout,grpo,trl")
    ap.add_argument("--hf-moe-tokens", type=int, default=32, help="generate's new tokens on the MoE (slow)")
    ap.add_argument("--grpo-steps", type=int, default=5)
    args = ap.parse_args()
    register_configs()
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    jobs = []  # the targets first: the GRPO step vs TRL, then the rollout tables
    if "targets" in sections:  # issues 15 and 16 side by side: decode vs generate, on vs off, the step vs TRL
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
    for job in jobs:
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


if __name__ == "__main__":
    main()
