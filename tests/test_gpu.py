"""The device seam: CPU-testable pieces of the GPU path, and `gpu`-marked tests that need CUDA.

pytest tests/test_gpu.py                  # CPU parts here; the gpu tests skip without CUDA
bash scripts/gpu_run.sh python -m pytest tests/test_gpu.py -m gpu     # on a GPU machine
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from detrl.config import ConfigError, ModelConfig
from detrl.device import resolve_device, resolve_dtype
from detrl.models import ops as ops_mod
from detrl.models.build import build_model
from detrl.models.forward import forward, fuse, rope_tables, token_logprobs
from detrl.models.logprobs import sequence_logprobs
from detrl.models.ops import (
    BATCH_INVARIANT_OPS,
    CUDA_DEFAULT_OPS,
    CUDA_INVARIANT_OPS,
    DEFAULT_OPS,
    cuda_attention,
    grouped_moe,
)
from detrl.rollout.base import Request, SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MOE = ModelConfig(name="qwen3_moe", num_experts=4, num_experts_per_tok=2)


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


def test_cpu_default_ops_are_the_cpu_sets():
    """device=cpu, float32, no recomputation: the op sets themselves (the CPU default's bits)."""
    from detrl import determinism as det_mod
    from detrl.runtime import make, ops_for

    assert ops_for(det_mod.setup(False, 0)) is DEFAULT_OPS
    assert ops_for(det_mod.setup(True, 0)) is BATCH_INVARIANT_OPS
    torch.use_deterministic_algorithms(False)
    gpu = make(det_mod.Determinism(det_mod.preset("off"), 0), torch.device("cuda"), torch.bfloat16)
    assert gpu.ops.moe is grouped_moe and gpu.ops.dtype == torch.bfloat16
    on = make(det_mod.Determinism(det_mod.preset("on"), 0), torch.device("cuda"), torch.bfloat16)
    assert on.ops == dataclasses.replace(CUDA_INVARIANT_OPS, dtype=torch.bfloat16)
    assert ops_for(det_mod.Determinism(det_mod.preset("on"), 0)) is BATCH_INVARIANT_OPS
    assert gpu.compile and not on.compile  # torch.compile with torch's kernels on CUDA only


def test_grouped_tile_map():
    """The grouped gemm's device-side tiles: every row of every expert in exactly one tile of <= BLOCK_M rows of
    that expert, unused tiles empty (the map has static size rows / BLOCK_M + E)."""
    triton_ops = pytest.importorskip("detrl.models.triton_ops")
    bm = triton_ops.BLOCK_M
    counts = torch.tensor([0, bm + 6, 3, 0, bm, 1, 2 * bm + 1, 0])
    e, lo, hi = triton_ops.tile_map(counts, int(counts.sum()))
    assert e.shape[0] == -(-int(counts.sum()) // bm) + len(counts)
    starts = torch.cumsum(counts, 0) - counts
    seen = torch.zeros(int(counts.sum()), dtype=torch.long)
    for ei, a, b in zip(e.tolist(), lo.tolist(), hi.tolist()):
        assert b - a <= bm
        if b > a:
            assert starts[ei] <= a and b <= starts[ei] + counts[ei]
            seen[a:b] += 1
    assert torch.equal(seen, torch.ones_like(seen))


def test_write_slots_scatters_and_restores_the_deterministic_mode():
    """The decode's cache/token writes: scatter_'s result, and torch's deterministic mode (and its warn_only) as
    they were, whether the write succeeds or raises."""
    from detrl.models.forward import write_slots

    dst, src = torch.zeros(2, 3, 5), torch.randn(2, 3, 1)
    idx = torch.tensor([1, 4])[:, None, None].expand(2, 3, 1)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        out = write_slots(dst.clone(), 2, idx, src)
        assert torch.equal(out, dst.clone().scatter_(2, idx, src))
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
        with pytest.raises(RuntimeError):
            write_slots(dst, 2, idx + 10, src)  # out of range
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
    finally:
        torch.use_deterministic_algorithms(False)


def test_preflight_names_the_varying_gemm_shape():
    """A gemm whose rows depend on the call's row count is refused by the per-shape check, naming op and shape."""
    from detrl.models import preflight

    model = build_model(ModelConfig(init="random"), seed=0)
    varying = dataclasses.replace(
        BATCH_INVARIANT_OPS,
        name="varying",
        linear=lambda x, w: F.linear(x, w) + 1e-3 * (x.numel() // x.shape[-1] > 20),
    )
    found = preflight.check_rows(fuse(model), varying)
    c = model.config
    assert found and found[0].startswith(
        f"linear q/k/v (K={c.hidden_size}, N={(c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim})"
    )
    assert not preflight.check_rows(fuse(model), BATCH_INVARIANT_OPS)


def test_row_invariance_check_is_per_device():
    ops_mod._gemm_is_row_invariant(32, 48, torch.float32, "cpu")
    assert (32, 48, torch.float32, "cpu", torch.get_num_threads()) in ops_mod._ROW_INVARIANT
    assert not any(k[3] != "cpu" for k in ops_mod._ROW_INVARIANT if k[:3] == (32, 48, torch.float32))


def test_grouped_moe_matches_dispatch():
    g = torch.Generator().manual_seed(0)
    x, gate_up, down = (
        torch.randn(12, 16, generator=g),
        torch.randn(4, 24, 16, generator=g),
        torch.randn(4, 16, 12, generator=g),
    )
    top_w, top_i = DEFAULT_OPS.route(torch.randn(12, 4, generator=g), 2, True)
    ref = ops_mod.moe_dispatch(
        x, top_w, top_i, gate_up, down, torch.nn.functional.linear, torch.nn.functional.silu
    )
    out = grouped_moe(x, top_w, top_i, gate_up, down, None, torch.nn.functional.silu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cuda_attention_matches_sdpa_on_cpu():
    """Training/prefill (T > 1 at positions 0..T-1: causal over the first T keys) and decode (masked)."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 8, 4, generator=g), torch.randn(2, 2, 8, 4, generator=g)
    q = torch.randn(2, 4, 5, 4, generator=g)
    mask = (torch.arange(8)[None, None, None, :] <= torch.arange(5)[None, None, :, None]).expand(2, 1, 5, 8)
    torch.testing.assert_close(cuda_attention(q, k, v, mask, 0.5), ops_mod.sdpa_attention(q, k, v, mask, 0.5))
    q1 = torch.randn(2, 4, 1, 4, generator=g)
    m1 = torch.arange(8)[None, None, None, :] <= torch.tensor([3, 6])[:, None, None, None]
    torch.testing.assert_close(cuda_attention(q1, k, v, m1, 0.5), ops_mod.sdpa_attention(q1, k, v, m1, 0.5))


@pytest.mark.parametrize("cfg", [ModelConfig(), MOE], ids=["dense", "moe"])
def test_chunked_logprobs_match_full(cfg):
    """The trainer's chunked head: same logprobs, entropies and gradients as the full [N, L, V] path."""
    model = build_model(dataclasses.replace(cfg, init="random"), seed=0)
    ops = dataclasses.replace(DEFAULT_OPS, moe=grouped_moe) if cfg.name == "qwen3_moe" else DEFAULT_OPS
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    rope = rope_tables(model.config, 16)
    logits = forward(model, ids, ops, 16, rope)
    ref, full = token_logprobs(logits[:, :-1], ids[:, 1:], 0.7)
    ref_ent = -(full.exp() * full).sum(-1)
    (ref.sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tok, ent = sequence_logprobs(model, ids, torch.ones(3, 15), ops, 16, rope, 0.7, entropy=True, chunk=7)
    (tok.sum() + 0.3 * ent.sum()).backward()
    torch.testing.assert_close(tok, ref)
    torch.testing.assert_close(ent, ref_ent)
    for p, r in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5)


def test_bf16_copies_train_float32_masters():
    model = build_model(ModelConfig(init="random"), seed=0)
    w = fuse(model, torch.bfloat16)
    assert w.embed.dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(0, 64, (2, 8))
    logits = forward(
        model,
        ids,
        dataclasses.replace(DEFAULT_OPS, dtype=torch.bfloat16),
        8,
        rope_tables(model.config, 8, "cpu", torch.bfloat16),
    )
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert model.model.embed_tokens.weight.grad.dtype == torch.float32


def test_activation_checkpointing_same_gradients():
    model = build_model(ModelConfig(init="random"), seed=0)
    ids = torch.randint(0, 64, (2, 8))
    rope = rope_tables(model.config, 8)
    grads = []
    for ops in (DEFAULT_OPS, dataclasses.replace(DEFAULT_OPS, checkpoint=True)):
        model.zero_grad()
        forward(model, ids, ops, 8, rope).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _requests(n: int, seeded: bool, prompt_len: int = 4):
    g = torch.Generator().manual_seed(3)
    return [
        Request(
            i // 4,
            i % 4,
            tuple(torch.randint(3, 64, (prompt_len + i % 3,), generator=g).tolist()),
            seed=1000 + i if seeded else None,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("cfg", [ModelConfig(), MOE], ids=["dense", "moe"])
def test_cuda_engine_logic_on_cpu_equals_embedded(cfg):
    """The CUDA engine's batching, static buffers and step function, run eagerly on the CPU with the
    batch-invariant ops: seeded results equal the CPU engine's, bit for bit (padding rows, bucket sizes,
    the stop check every k tokens and the results' order change nothing)."""
    from detrl.rollout.cuda import CudaEngine
    from detrl.rollout.embedded import EmbeddedEngine

    model = build_model(dataclasses.replace(cfg, init="random"), seed=0)
    params = SamplingParams(1.0, 1.0, 6, (2,))
    reqs = _requests(11, seeded=True)
    ref = EmbeddedEngine(model, BATCH_INVARIANT_OPS, 16, params, seed=0).run_batch(reqs)
    eng = CudaEngine(
        model,
        BATCH_INVARIANT_OPS,
        16,
        params,
        seed=0,
        max_batch_size=8,
        device="cpu",
        dtype=torch.float32,
        graphs=False,
        sync_every=2,
    )
    out = eng.generate(reqs)
    assert [r.uid for r in out] == [r.uid for r in reqs]
    assert [(r.tokens, r.logprobs, r.finish_reason) for r in out] == [
        (r.tokens, r.logprobs, r.finish_reason) for r in ref
    ]
    # weight sync through the weightless twin, on the device
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    eng.update_weights(model.state_dict())
    for a, b in zip(eng.weights.tensors(), fuse(model).tensors()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- GPU


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [ModelConfig(), MOE], ids=["dense", "moe"])
def test_gpu_graph_replay_equals_eager(cfg):
    """Seeded sampling: the captured decode step gives the eager step's tokens and logprobs, bit for bit;
    an unseeded call runs and returns every request (completion order under dynamic routing)."""
    from detrl.rollout.cuda import CudaEngine

    model = build_model(dataclasses.replace(cfg, init="random", vocab_size=512), seed=0).cuda()
    params = SamplingParams(1.0, 1.0, 12, (2,))
    ops = dataclasses.replace(CUDA_DEFAULT_OPS, dtype=torch.bfloat16)
    reqs = _requests(20, seeded=True)
    outs = []
    for graphs in (False, True, True):
        eng = CudaEngine(
            model, ops, 32, params, seed=0, max_batch_size=32, graphs=graphs, sync_every=4, compile=True
        )
        outs.append([(r.tokens, r.logprobs) for r in eng.generate(reqs)])
    assert outs[0] == outs[1] == outs[2]
    eng = CudaEngine(model, ops, 32, params, seed=0, max_batch_size=8, fixed_routing=False, compile=True)
    out = eng.generate(_requests(20, seeded=False))
    assert sorted(r.uid for r in out) == sorted(r.uid for r in _requests(20, seeded=False))


@cuda
@pytest.mark.gpu
def test_gpu_trainer_logprobs_close_to_rollout(tmp_path):
    """A short GRPO run on CUDA (bf16 compute, float32 masters): trainer logprobs of the sampled tokens
    agree with the engine's to bf16 precision; determinism=off."""
    from tests.conftest import run_tiny

    rows = run_tiny(tmp_path, "device=cuda", "determinism=off", "model.init=random")
    assert len(rows) == 3
    assert all(r["mismatch/train_rollout_logprob_abs_diff"] < 0.05 for r in rows)


@pytest.mark.parametrize("cfg", [ModelConfig(), MOE], ids=["dense", "moe"])
def test_preflight_passes_invariant_ops_and_catches_default(cfg):
    """Issue 16's preflight on the CPU: the batch-invariant ops pass (rows and prefill/decode phases), and the
    default ops, as the negative control, are caught (prefill vs decode logprobs differ on CPU)."""
    from detrl.models import preflight

    model = build_model(dataclasses.replace(cfg, init="random"), seed=0)
    w, rope = fuse(model), rope_tables(model.config, 16)
    preflight.require(w, BATCH_INVARIANT_OPS, 16, rope)
    assert preflight.negative_control(w, DEFAULT_OPS, 16, rope)


@cuda
@pytest.mark.gpu
def test_gpu_preflight():
    """On the GPU: the invariant ops in bf16 pass; the default CUDA ops are caught."""
    from detrl.models import preflight

    model = build_model(ModelConfig(init="random", vocab_size=512), seed=0).cuda()
    w, rope = fuse(model, torch.bfloat16), rope_tables(model.config, 32, "cuda", torch.bfloat16)
    preflight.require(w, BATCH_INVARIANT_OPS, 32, rope)
    assert preflight.negative_control(
        w, dataclasses.replace(CUDA_DEFAULT_OPS, dtype=torch.bfloat16), 32, rope
    )


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [ModelConfig(), MOE], ids=["dense", "moe"])
def test_gpu_invariant_ops_pass_preflight_and_engine_equals_trainer(cfg):
    """The Triton op set on the GPU in bf16: the preflight passes (gemm shapes over row counts, rows, phases);
    the CUDA engine with CUDA graphs gives the eager engine's tokens and logprobs, bit for bit, and its logprobs
    equal the trainer's (sequence_logprobs) exactly."""
    from detrl.models import preflight
    from detrl.rollout.cuda import CudaEngine

    model = build_model(dataclasses.replace(cfg, init="random", vocab_size=512), seed=0).cuda()
    ops = dataclasses.replace(CUDA_INVARIANT_OPS, dtype=torch.bfloat16)
    rope = rope_tables(model.config, 32, "cuda", torch.bfloat16)
    preflight.require(fuse(model, torch.bfloat16), ops, 32, rope)
    params = SamplingParams(1.0, 1.0, 12, ())
    reqs = _requests(20, seeded=True)
    outs = [
        CudaEngine(model, ops, 32, params, seed=0, max_batch_size=m, graphs=g).generate(reqs)
        for g, m in ((False, 32), (True, 32), (True, 8))
    ]
    assert (
        [(r.tokens, r.logprobs) for r in outs[0]]
        == [(r.tokens, r.logprobs) for r in outs[1]]
        == [(r.tokens, r.logprobs) for r in outs[2]]
    )
    ids = torch.zeros(len(reqs), 32, dtype=torch.long)
    mask = torch.zeros(len(reqs), 31)
    for i, (q, r) in enumerate(zip(reqs, outs[1])):
        seq = list(q.prompt_ids) + r.tokens
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(q.prompt_ids) - 1 : len(seq) - 1] = 1
    with torch.no_grad():
        tok, _ = sequence_logprobs(model, ids.cuda(), mask.cuda(), ops, 32, rope, 1.0)
    trainer = [
        tok[i, len(q.prompt_ids) - 1 : len(q.prompt_ids) - 1 + len(r.tokens)].tolist()
        for i, (q, r) in enumerate(zip(reqs, outs[1]))
    ]
    assert trainer == [r.logprobs for r in outs[1]]


@pytest.mark.gpu
@cuda
def test_gpu_probe_on_row_gives_one_output():
    """`python -m detrl.probe device=cuda`: the CUDA engine with its op sets; all pinned gives one output per
    target, and nothing varying (the control) too."""
    from detrl.probe import ROWS, probe
    from tests.conftest import make_cfg

    rows = {k: ROWS[k] for k in ("control", "determinism=on")}
    counts = probe(make_cfg("device=cuda", "warmstart.steps=40", "logger=none"), trials=8, rows=rows)
    assert all(v == (1, 1) for by_mode in counts.values() for v in by_mode.values()), counts


@pytest.mark.gpu
@cuda
def test_gpu_float32_with_invariant_kernels_is_refused_in_one_line():
    from detrl.builder import build
    from tests.conftest import make_cfg

    with pytest.raises(ConfigError, match=r"^model.dtype=float32 is not valid with determinism.kernels="):
        build(make_cfg("device=cuda", "model.dtype=float32", "logger=none"))
