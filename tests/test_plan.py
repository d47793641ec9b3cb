"""The memory planner: parameter counts against transformers' models, the arithmetic on hand-computed cases,
the CLI's verdicts on the recipes, and train.py's refusal of a run that cannot fit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, make_cfg
from detrl import plan as planner
from detrl.plan import memory as mem
from detrl.plan.memory import FSDP2, TODAY, Layout, Shapes, Workload

# hand-countable: block = q|k|v 4 x (2 + 2) x 2 = 32, o 2 x 2 x 4 = 16, q/k norms 2 x 2, two norms 2 x 4, MLP 3 x 4 x 8
# = 96 -> 156; params = embed 40 + head 40 + final norm 4 + 2 x 156 = 396
TINY = Shapes(vocab=10, hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2)


def _work(**kw) -> Workload:
    base = dict(
        device="cuda",
        compute_bytes=2,
        ctx_len=8,
        micro_batch=2,
        micro_batches=5,
        batch_rows=10,
        engine_requests=10,
        engine_batch=4,
    )
    return Workload(**{**base, **kw})


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model=qwen3_moe",),
        ("model.tie_word_embeddings=true",),
        ("model=qwen3_8b",),
        ("model=qwen3_30b_a3b",),
    ],
)
def test_parameter_count_is_the_models(overrides):
    from detrl.models.build import build_model

    cfg = make_cfg("model.init=random", *overrides)
    with torch.device("meta"):  # shapes only: the 30B model costs nothing
        model = build_model(cfg.model, seed=0)
    assert planner.shapes_of(cfg.model).params == sum(p.numel() for p in model.parameters())


def test_hand_counted_shapes():
    assert (TINY.block, TINY.params) == (156, 396)
    assert TINY.fused_copies == 2 * (32 + 2 * 4 * 8)  # q|k|v and gate|up of each block
    assert TINY.kv_per_token(2) == 2 * 2 * 1 * 2 * 2


def test_resident_parts_shard_with_the_world():
    r = mem.resident(TINY, _work(), TODAY, world=2)
    assert r["master weights"] == 396 * 4 / 2
    assert r["optimizer state"] == 2 * 396 * 4 / 2
    assert r["reference model"] == 396 * 4 / 2
    # either engine: its fused weights (396 parameters + the q/k norms' per-head rows, 2 x (2 + 1 - 2) x 2),
    # whole, in the compute dtype; the CPU engine holds no fp32 model beside them (was 396 x (4 + 4))
    assert r["engine weights"] == 400 * 2
    assert mem.resident(TINY, _work(device="cpu", compute_bytes=4), TODAY, 2)["engine weights"] == 400 * 4
    tied = dataclasses.replace(
        TINY, tied=True
    )  # params 356; the engine clones the head apart from the embedding
    assert (tied.params, tied.engine_elements) == (356, 356 + 4 + 40)


@pytest.mark.parametrize("overrides", [(), ("model.tie_word_embeddings=true",), ("model=qwen3_moe",)])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cpu_engine_term_is_what_the_engine_holds(overrides, dtype):
    # the planner's CPU engine part against an EmbeddedEngine built as rollout/registry.py builds it: its tensors'
    # bytes are the fused weights in the compute dtype, and it keeps no module (no fp32 model copy)
    from detrl.models.build import build_model
    from detrl.models.ops import BATCH_INVARIANT_OPS
    from detrl.rollout.base import SamplingParams
    from detrl.rollout.embedded import EmbeddedEngine

    cfg = make_cfg("model.init=random", *overrides)
    model = build_model(cfg.model, seed=0)
    ops = dataclasses.replace(BATCH_INVARIANT_OPS, dtype=dtype)
    engine = EmbeddedEngine(model, ops, 16, SamplingParams(), seed=0)
    try:
        held = sum(t.numel() * t.element_size() for t in engine.weights.tensors())
        assert not any(isinstance(v, torch.nn.Module) for v in vars(engine).values())
    finally:
        engine.close()
    c = 2 if dtype == torch.bfloat16 else 4
    w = _work(device="cpu", compute_bytes=c)
    assert mem.resident(planner.shapes_of(cfg.model), w, TODAY, 2)["engine weights"] == held


def test_stash_reduce_buffers():
    # 5 micro-batches on 2 ranks: kmax 3; backward: the unsharded gradient + 2 stashed; reduce: 2 x 3 + 2 x 3 + 1
    p = 396 * 4
    assert mem.gradients(TINY, _work(), TODAY, 2, reducing=False) == (p, 2 * p)
    assert mem.gradients(TINY, _work(), TODAY, 2, reducing=True) == (p / 2, 13 * p)
    assert mem.gradients(TINY, _work(ordered=False), TODAY, 2, reducing=True) == (p + p / 2, p)
    assert mem.gradients(TINY, _work(), TODAY, 1, reducing=True) == (p, 0.0)
    # shard: accumulator shard + one block's gradient, and that block's receive
    assert mem.gradients(TINY, _work(), FSDP2, 2, reducing=True) == (p / 2 + 156 * 4, 156 * 4)


def test_kv_pool_formulas():
    # 10 requests over 2 ranks: 5 each, batches of <= 4 -> 4 rows; 16 B a token, ctx 8
    assert mem.engine_rows(_work(), 2) == 4
    assert mem.kv_pool(TINY, _work(), TODAY, 2) == 4 * 8 * 16  # static: bucket 4
    assert mem.kv_pool(TINY, _work(engine_batch=3), TODAY, 2) == 4 * 8 * 16  # 3 rows run in bucket 4
    assert mem.kv_pool(TINY, _work(engine_batch=3), FSDP2, 2) == 3 * 8 * 16  # paged: what the rows need
    capped = Layout(**{**vars(FSDP2), "kv_cap_tokens": 10})
    assert mem.kv_pool(TINY, _work(), capped, 2) == 10 * 16
    cpu = _work(
        device="cpu", compute_bytes=4, engine_workers=2
    )  # 5 requests a rank on 2 workers: 3 rows each
    assert mem.kv_pool(TINY, cpu, TODAY, 2) == 2 * 3 * 8 * 32


def test_activation_arithmetic():
    # per token per block: 6 H + 4 (Hq + Hkv) D + Hkv D + 2 Hq D + 5 I = 24 + 24 + 2 + 8 + 40 = 98 elements
    assert mem.layer_activation(TINY, _work()) == 98 * 2
    w = _work(compute_bytes=4, attention="flash")
    tokens = 2 * 8
    head = 2 * tokens * 4 * 4 + 4 * tokens * 10 * 4  # 4 chunks of [16 rows, 10] fp32 logits
    mask = 2 * 8 * 8  # the pass's [2 seqs, 1, 8, 8] bool mask
    assert (
        mem.activations(TINY, w) == 3 * tokens * 98 * 4 + mask + head
    )  # 2 blocks saved + 1 for the gradients
    ck = _work(compute_bytes=4, attention="flash", checkpointing=True)
    assert mem.activations(TINY, ck) == 2 * tokens * 4 * 4 + 2 * tokens * 98 * 4 + mask + head
    scores = 2 * 2 * 8 * 8 * 4  # [2 seqs, 2 heads, 8, 8] fp32
    # materialised: both layers' probabilities and inverted masks saved, 2 more score tensors in the backward
    assert mem.activations(TINY, _work(compute_bytes=4)) == 3 * tokens * 98 * 4 + 4 * scores + 3 * mask + head


QWEN3_8B = Shapes(
    vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128
)


def test_the_query_chunk_is_the_codes():
    from detrl.models import primitives

    assert mem.ATTN_QUERY_CHUNK == primitives.ATTN_QUERY_CHUNK == 1024


@pytest.mark.parametrize("device,c,nbytes", [("cuda", 2, 4), ("cpu", 4, 4), ("cpu", 2, 2)])
def test_pieces_bound_the_attention_at_a_long_context(device, c, nbytes):
    # dapo's context (2,048 + 20,480 new tokens): one piece of 1,024 query rows at a time, never [1, 32, T, T]
    ctx, s = 22528, QWEN3_8B
    w = _work(device=device, compute_bytes=c, ctx_len=ctx, micro_batch=1, attention="pieces")
    piece = 1 * 32 * 1024 * ctx * nbytes  # [1, Hq, 1024, L]: CUDA's recomputation softmax in fp32
    assert mem.query_rows(w) == 1024
    assert mem.attention_scores(s, w, 1) == piece
    repeated = 3 * 1 * 32 * ctx * 128 * c + 2 * 1 * 8 * ctx * 128 * 4 if device == "cuda" else 0
    assert mem.attention_backward(s, w, 1) == 3 * piece + repeated
    flash = mem.activations(s, mem.replace(w, attention="flash"))
    assert mem.activations(s, w) - flash == 3 * piece + repeated
    whole = 1 * 32 * ctx * ctx * nbytes  # what one layer's [1, H, T, L] would take
    assert mem.activations(s, w) - flash < 3 * whole / 20  # bounded by the piece (22 pieces of 1,024 rows)
    # the layers do not add up: the forward saves no probabilities in pieces
    deeper = dataclasses.replace(s, layers=72)
    assert (
        mem.activations(deeper, w) - mem.activations(deeper, mem.replace(w, attention="flash"))
        == 3 * piece + repeated
    )
    ck = mem.replace(w, checkpointing=True)
    assert (
        mem.activations(s, ck) - mem.activations(s, mem.replace(ck, attention="flash"))
        == 3 * piece + repeated
    )


def test_a_short_pass_is_one_piece():
    # ctx <= 1,024: the CUDA backward recomputes the whole pass once (pieces == recompute); the CPU op is not cut
    w = _work(ctx_len=1000, micro_batch=2, attention="pieces")
    assert mem.query_rows(w) == 1000
    assert mem.attention_backward(QWEN3_8B, w, 2) == mem.attention_backward(
        QWEN3_8B, mem.replace(w, attention="recompute"), 2
    )
    assert mem.attention_mode("cpu", True, "pieces", 1024) == "materialised"
    assert mem.attention_mode("cpu", True, "pieces", 1032) == "pieces"


@pytest.mark.parametrize(
    "device,invariant,backward,want",
    [
        ("cuda", True, "pieces", "pieces"),  # Triton attention, attention_backward in pieces
        ("cpu", True, "pieces", "pieces"),  # bi_attention, query_chunked
        ("cuda", True, "torch", "recompute"),  # before: one layer's [B, H, T, L] recomputed
        ("cpu", True, "torch", "materialised"),  # before: every layer's saved
        ("cuda", False, "pieces", "flash"),  # SDPA is_causal
        ("cpu", False, "pieces", "flash"),  # torch's CPU flash kernel: no probabilities saved
        ("cuda", True, "flash", "flash"),
    ],
)
def test_attention_mode_per_op_set(device, invariant, backward, want):
    assert mem.attention_mode(device, invariant, backward, 22528) == want


def test_the_code_layout_runs_the_attention_in_pieces():
    from detrl.plan.__main__ import compose

    cfg = compose(["experiment=dapo_math_qwen3_8b"])
    ctx = planner.context_bound(cfg)
    assert ctx == 22528 and planner.code_layout().attn_backward == "pieces"
    assert planner.workload_of(cfg, ctx, "cuda").attention == "pieces"
    assert planner.workload_of(cfg, ctx, "cuda", TODAY).attention == "recompute"
    assert (
        planner.workload_of(
            compose(["experiment=dapo_math_qwen3_8b", "determinism=off"]), ctx, "cuda"
        ).attention
        == "flash"
    )
    p, s, w, _ = planner.for_config(cfg, ctx, 8, "cuda", 141 * mem.GIB)
    assert w.attention == "pieces" and p.phases["backward"]["activations"] == mem.activations(s, w)


def test_gathered_copies():
    w = _work()
    assert mem.gathered(TINY, w, TODAY, 1) == 396 * 2  # world 1: the bf16 cast of every parameter
    assert mem.gathered(TINY, _work(compute_bytes=4), TODAY, 1) == TINY.fused_copies * 4  # fp32: the concats
    assert mem.gathered(TINY, w, TODAY, 2) == 396 * 4 + 396 * 2  # fp32 unshard + its bf16 cast
    root = 396 - 2 * 156
    assert mem.gathered(TINY, w, FSDP2, 2) == (2 * 156 + root) * 2 + TINY.fused_copies * 2


def test_fits_at_the_budget_and_not_a_byte_below():
    need = mem.plan(TINY, _work(), TODAY, 2, 0.0).per_rank
    assert mem.plan(TINY, _work(), TODAY, 2, need).fits
    assert not mem.plan(TINY, _work(), TODAY, 2, need - 1).fits
    p = mem.plan(TINY, _work(), TODAY, 2, need)
    assert p.per_rank == max(sum(ph.values()) for ph in p.phases.values()) == sum(p.parts.values())


def test_min_world_is_the_first_that_fits():
    s = planner.shapes_of(make_cfg("model=qwen3_8b").model)
    w = _work(ctx_len=1024, micro_batch=4, micro_batches=8, checkpointing=True, attention="recompute")
    need = mem.min_world(s, w, FSDP2, 80 * mem.GIB)
    assert need is not None and need > 1
    assert mem.plan(s, w, FSDP2, need, 80 * mem.GIB).fits
    assert not mem.plan(s, w, FSDP2, need - 1, 80 * mem.GIB).fits


def test_layout_is_read_from_the_code(monkeypatch):
    from detrl import distributed

    # distributed.py declares what it changed from today's layout (the ordered reduce's shard accumulator)
    assert planner.code_layout() == dataclasses.replace(TODAY, **distributed.PLAN_LAYOUT)
    monkeypatch.setattr(distributed, "PLAN_LAYOUT", {}, raising=False)
    assert planner.code_layout() == TODAY  # nothing declared: today's layout
    monkeypatch.setattr(distributed, "PLAN_LAYOUT", {"gather": "block", "reduce": "shard"}, raising=False)
    assert (planner.code_layout().gather, planner.code_layout().reduce) == ("block", "shard")
    monkeypatch.setattr(distributed, "PLAN_LAYOUT", {"gather": "layer"}, raising=False)
    with pytest.raises(
        ValueError, match=r"layout.gather='layer' is not valid; choose one of \['model', 'block'\]"
    ):
        planner.code_layout()
    monkeypatch.setattr(distributed, "PLAN_LAYOUT", {"attn_backward": "chunks"}, raising=False)
    with pytest.raises(
        ValueError,
        match=r"layout.attn_backward='chunks' is not valid; choose one of \['torch', 'pieces', 'flash'\]",
    ):
        planner.code_layout()


def _cli(tmp_path, *args):
    from detrl.plan.__main__ import main

    out = tmp_path / "plan.json"
    rc = main([*args, "--json", str(out)])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["code", "fsdp2"])
def test_cli_recipe_fits_on_8_and_not_on_1(tmp_path, layout):
    args = ("experiment=qwen3_8b_gsm8k_grpo", "activation_checkpointing=true", "--layout", layout)
    rc, on8 = _cli(tmp_path, *args, "--world-size", "8", "--device-memory-gib", "141")
    assert rc == 0 and on8["fits"] is True and on8["per_rank_gib"] <= 141
    assert on8["per_rank_gib"] == pytest.approx(sum(on8["parts_gib"].values()))
    rc, on1 = _cli(tmp_path, *args, "--world-size", "1", "--device-memory-gib", "141")
    assert rc == 1 and on1["fits"] is False and on1["per_rank_gib"] > 141
    assert "largest part: optimizer state" in on1["verdict"]


def test_no_micro_batch_note_names_the_piece(tmp_path):
    # dapo at determinism=on on the code layout: at 141 GiB a smaller micro-batch fits (the advice says which);
    # at 70 GiB none does, and the note says what the attention holds now (one 1,024-row piece), not
    # [micro_batch, heads, ctx, ctx] (at 80 GiB micro_batch_size=1 fits since the random init is built sharded)
    rc, out = _cli(
        tmp_path, "experiment=dapo_math_qwen3_8b", "micro_batch_size=8", "--world-size", "8",
        "--device-memory-gib", "141",
    )  # fmt: skip
    assert rc == 1 and out["fits"] is False and "set micro_batch_size=2" in out["verdict"]
    rc, out = _cli(
        tmp_path, "experiment=dapo_math_qwen3_8b", "rollout.max_batch_size=1", "--world-size", "8",
        "--device-memory-gib", "70",
    )  # fmt: skip
    assert rc == 1 and "largest part: activations" in out["verdict"]
    assert "[1, 32, 1024, 22528] scores at a time" in out["verdict"]


def test_cli_needs_a_prompt_bound(capsys):
    from detrl.plan.__main__ import main

    rc = main(["data=gsm8k", "model=qwen3_8b", "--world-size", "8", "--device-memory-gib", "141"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "set data.max_prompt_length=N" in err


def test_default_run_is_not_refused():
    cfg = make_cfg()
    planner.require_fits(cfg, planner.context_bound(cfg), 1, torch.device("cpu"))


def test_train_refuses_what_cannot_fit_in_one_line(tmp_path):
    # Qwen3-30B-A3B's shapes on this CPU: ~0.5 TB; refused before the model is built
    proc = subprocess.run(
        [sys.executable, "train.py", "model=qwen3_30b_a3b", "logger=none", f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("detrl: does not fit:") and "largest part:" in err[0]


def test_advice_names_a_change_that_fits(tmp_path):
    import re

    base = ("experiment=dapo_math_qwen3_8b", "micro_batch_size=8", "rollout.max_batch_size=32")
    size = ("--layout", "fsdp2", "--world-size", "8", "--device-memory-gib", "141")
    rc, before = _cli(tmp_path, *base, *size)
    assert rc == 1 and "largest part: activations" in before["verdict"]
    mb = re.search(r"set micro_batch_size=(\d+)", before["verdict"])
    assert mb, before["verdict"]
    rc, after = _cli(tmp_path, *base, f"micro_batch_size={mb.group(1)}", *size)
    assert rc == 0 and after["fits"]
    rc, twice = _cli(tmp_path, *base, f"micro_batch_size={2 * int(mb.group(1))}", *size)
    assert rc == 1  # the largest micro-batch that fits, not any smaller one


def test_shapes_come_from_the_checkpoints_config(tmp_path):
    # model.path's config.json wins over the preset (no weights are read)
    cfg = make_cfg("model=qwen3_8b")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": 3}))
    cfg.model.path = str(tmp_path)
    s = planner.shapes_of(cfg.model)
    assert (s.hidden, s.layers, s.vocab) == (1024, 3, 151936)


def test_cli_bad_world_size_is_one_line(capsys):
    from detrl.plan.__main__ import main

    assert main(["--world-size", "0", "--device-memory-gib", "141"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "detrl.plan: --world-size=0 is not valid: must be > 0"


def test_several_ranks_plan_the_recomputation_the_sharded_forward_always_does():
    # models/forward.py recomputes every block of a sharded model in the backward, checkpointing asked or not
    cfg, ckpt = make_cfg("model=qwen3_8b"), make_cfg("model=qwen3_8b", "activation_checkpointing=true")
    assert not cfg.activation_checkpointing

    def backward(c, world):
        p, *_ = planner.for_config(c, 1536, world, "cuda", 141 * planner.GIB)
        return p.phases["backward"]["activations"]

    assert backward(cfg, 2) == backward(ckpt, 2) < backward(cfg, 1)


def test_every_init_on_several_ranks_plans_the_sharded_construction(tmp_path):
    # the warm start is a save_pretrained directory: under torchrun its shards are read from it, as model.path's
    # are (builder.sharded_build); a random init is replayed from the seed, each rank its rows (sharded_init)
    warm, rand, path = make_cfg(), make_cfg("model.init=random"), make_cfg(f"model.path={tmp_path}")

    def construct(c, world):
        return planner.config_layout(planner.code_layout(), c, world).construct

    assert [construct(c, 2) for c in (warm, rand, path)] == ["sharded"] * 3
    assert [construct(c, 1) for c in (warm, rand, path)] == ["full"] * 3
    p2, *_ = planner.for_config(warm, planner.context_bound(warm), 2, "cpu", 64 * planner.GIB)
    assert (
        p2.phases["preflight"]["master weights"] < planner.shapes_of(warm.model).params * 4
    )  # the shards only
