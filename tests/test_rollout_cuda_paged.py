"""CudaPagedEngine: the device engine on the paged scheduler core.

On CPU the same class (device=cpu, gathered keys, the given op set) must give the embedded engine's worker bits
exactly, dense and MoE; on a GPU (marked gpu) it must give the trainer's logprobs exactly under `on` and be
invariant to arrival order and the batch cap."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from detrl.config import ModelConfig
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, build_model
from detrl.rollout import EmbeddedEngine, SamplingParams
from detrl.rollout.cuda_paged import DEVICE_POOL, CudaPagedEngine
from detrl.rollout.paged import PoolSpec
from tests.rollout_helpers import EOS, bits, group_requests, tiny_model

CTX = 64
PARAMS = SamplingParams(1.0, 1.0, 24, (EOS,))


def _requests(groups=3, n=4, seeded=True):
    return group_requests(groups, n, lambda g: tuple(3 + (g * 5 + i) % 40 for i in range(4 + 9 * g)), seeded)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("ops", [BATCH_INVARIANT_OPS, DEFAULT_OPS], ids=["on", "off"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "stream"])
def test_on_cpu_it_gives_the_embedded_workers_bits(name, ops, seeded):
    """Two calls (the stream advances), a weight update between them (the pool released and rebuilt). Under
    `off` torch's CPU kernels depend on the thread count: this process runs with the worker's one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, reqs = tiny_model(name), _requests(seeded=seeded)
    kw = dict(max_batch_size=5, pool=PoolSpec(block_size=4, prefill_chunk=8, kv_pool_tokens=64 * 4))
    emb = EmbeddedEngine(model, ops, CTX, PARAMS, seed=3, num_workers=1, **kw)
    pag = CudaPagedEngine(model, ops, CTX, PARAMS, seed=3, device="cpu", **kw)
    try:
        first = emb.generate(reqs)
        assert bits(pag.generate(reqs)) == bits(first)
        assert pag.stat("hit_blocks") > 0  # the samples of a group shared the prompt's blocks
        state = {k: v + 0.01 for k, v in model.state_dict().items()}
        emb.update_weights(state)
        pag.update_weights(state)
        assert pag.core.pool is None  # released at the update
        second = emb.generate(reqs)
        assert bits(second) != bits(first)
        assert bits(pag.generate(reqs)) == bits(second)
        if name == "qwen3_moe":
            assert all(
                r.routed_experts is not None and len(r.routed_experts) == len(r.tokens) for r in second
            )
    finally:
        emb.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "stream"])
def test_a_padded_decode_step_gives_the_eager_steps_bits(name, seeded):
    """The CUDA graphs' step, run eagerly on CPU (capture=False): rows padded to a power-of-two bucket that
    write the sink block and read the zero block, keys read at a power-of-two width, seeded rows sampled by the
    step itself. Under the batch-invariant ops every token, logprob and expert id is the plain step's, across a
    weight update (the pool rebuilt)."""
    from detrl.rollout.cuda_graphs import DecodeGraphs

    model, reqs = tiny_model(name), _requests(seeded=seeded)
    kw = dict(max_batch_size=5, pool=PoolSpec(block_size=4, prefill_chunk=8, kv_pool_tokens=64 * 4))
    plain = CudaPagedEngine(model, BATCH_INVARIANT_OPS, CTX, PARAMS, seed=3, device="cpu", **kw)
    padded = CudaPagedEngine(
        model, BATCH_INVARIANT_OPS, CTX, PARAMS, seed=3, device="cpu", overlap=False, **kw
    )
    steps = []

    class Counted(DecodeGraphs):
        def __call__(self, pool, tokens, *rest):
            out = super().__call__(pool, tokens, *rest)
            steps.append((tokens.shape[0], out[2] is not None))  # rows, sampled in the step
            return out

    graphs = Counted(padded.weights, padded.ops, CTX, 4, padded.core.rope, 5, "cpu", capture=False)
    padded.core.decode = graphs
    for _ in range(2):
        ref = plain.generate(reqs)
        assert bits(padded.generate(reqs)) == bits(ref)
        if name == "qwen3_moe":
            got = {r.uid: r.routed_experts for r in padded.generate(reqs)}
            assert all(np.array_equal(got[r.uid], r.routed_experts) for r in plain.generate(reqs))
        assert {3, 5} & {n for n, _ in steps}  # steps of 3 and 5 rows ran padded to 4 and 8
        assert {drawn for _, drawn in steps} == {
            seeded
        }  # seeded rows sampled in the step, stream rows by the core
        state = {k: v + 0.01 for k, v in model.state_dict().items()}
        plain.update_weights(state)
        padded.update_weights(state)
        assert graphs.pool is None  # the pool's graphs dropped with it


@pytest.mark.parametrize("chunk, top_p", [(1, 1.0), (8, 0.9)])
def test_prefill_chunks_of_one_token_and_top_p_keep_the_plain_steps_bits(chunk, top_p):
    """With prefill_chunk=1 a prefill step is one token a row too; its rows are mid-prompt and must not sample:
    the graphs' runner serves decode steps only. At top_p < 1 the step's own draw masks the nucleus as the core's
    does. Both give the plain engine's bits."""
    from detrl.rollout.cuda_graphs import DecodeGraphs

    model, reqs = tiny_model("qwen3"), _requests(groups=2, n=3)
    kw = dict(max_batch_size=4, pool=PoolSpec(block_size=4, prefill_chunk=chunk, kv_pool_tokens=64 * 4))
    params = dataclasses.replace(PARAMS, top_p=top_p)
    plain = CudaPagedEngine(model, BATCH_INVARIANT_OPS, CTX, params, seed=3, device="cpu", **kw)
    padded = CudaPagedEngine(
        model, BATCH_INVARIANT_OPS, CTX, params, seed=3, device="cpu", overlap=False, **kw
    )
    padded.core.decode = DecodeGraphs(
        padded.weights, padded.ops, CTX, 4, padded.core.rope, 4, "cpu", capture=False
    )
    assert bits(padded.generate(reqs)) == bits(plain.generate(reqs))


def _overlapped(model, params, max_batch_size, pool_tokens):
    """A plain engine and one whose decode steps run one ahead of the host (the graphs' step, eager on CPU)."""
    from detrl.rollout.cuda_graphs import DecodeGraphs

    kw = dict(
        max_batch_size=max_batch_size,
        pool=PoolSpec(block_size=4, prefill_chunk=8, kv_pool_tokens=pool_tokens),
    )
    plain = CudaPagedEngine(
        model, BATCH_INVARIANT_OPS, CTX, params, seed=3, device="cpu", overlap=False, **kw
    )
    ahead = CudaPagedEngine(model, BATCH_INVARIANT_OPS, CTX, params, seed=3, device="cpu", **kw)
    ahead.core.decode = DecodeGraphs(
        ahead.weights, ahead.ops, CTX, 4, ahead.core.rope, max_batch_size, "cpu", capture=False
    )
    return plain, ahead


STOPS = dataclasses.replace(PARAMS, stop_token_ids=(3, 4))  # ~1 in 30 draws stops: lengths spread


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize(
    "cap, pool_tokens", [(12, 64 * 12), (5, 64 * 4), (4, 20 * 4)], ids=["all", "cap5", "preempt"]
)
def test_decode_steps_one_ahead_of_the_host_keep_the_plain_cores_bits(name, cap, pool_tokens):
    """Seeded rows with stop tokens: a step launched before the previous one was read (its input tokens the
    device's, rows that stopped running one wasted step) gives every token, logprob, finish reason and expert id
    of the plain core, with every request admitted at once, with a batch cap (rows join as others leave) and
    with a pool small enough to preempt; across a weight update."""
    model, reqs = tiny_model(name), _requests(groups=3, n=4)
    plain, ahead = _overlapped(model, STOPS, cap, pool_tokens)
    for _ in range(2):
        ref = plain.generate(reqs)
        assert bits(ahead.generate(reqs)) == bits(ref)
        assert len({len(r.tokens) for r in ref}) > 3 and {r.finish_reason for r in ref} == {"stop", "length"}
        assert ahead.core.pipelined > 0 and ahead.core.flight is None
        assert (ahead.stat("preemptions") > 0) == (cap == 4)  # (counted since the last update)
        if cap == 12:  # no block evicted: every block the plain core cached is cached (its tokens read first)
            assert set(plain.core.manager.by_hash) <= set(ahead.core.manager.by_hash)
        state = {k: v + 0.01 for k, v in model.state_dict().items()}
        plain.update_weights(state)
        ahead.update_weights(state)


def test_a_cut_while_a_step_is_in_flight_returns_the_plain_cores_tokens():
    """`stop_when` (dynamic routing) cuts the call once two results are in: the step in flight is dropped, so every
    cut row holds the tokens the plain core's had when it cut, bit for bit."""
    model, reqs = tiny_model("qwen3"), _requests(groups=3, n=4)
    plain, ahead = _overlapped(model, STOPS, 12, 64 * 12)
    plain.fixed_routing = ahead.fixed_routing = False
    ref = plain.generate(reqs, stop_when=lambda done: len(done) >= 2)
    got = ahead.generate(reqs, stop_when=lambda done: len(done) >= 2)
    assert "abort" in {r.finish_reason for r in ref} and ahead.core.pipelined > 0
    assert sorted(bits(got)) == sorted(bits(ref))


def test_stream_rows_run_ahead_too_and_without_stop_tokens_keep_the_plain_bits():
    """Unseeded rows (determinism off): the core draws from the stream on the device and the host runs ahead.
    Without stop tokens no step is wasted, so the stream's draws and every bit are the plain core's; with them a
    stopped row's wasted step takes draws too (as SGLang's), and each result still ends as its tokens say."""
    model, reqs = tiny_model("qwen3"), _requests(groups=3, n=4, seeded=False)
    plain, ahead = _overlapped(model, dataclasses.replace(PARAMS, stop_token_ids=()), 12, 64 * 12)
    assert bits(ahead.generate(reqs)) == bits(plain.generate(reqs))
    assert ahead.core.pipelined > 0
    _, ahead = _overlapped(model, STOPS, 5, 64 * 4)
    out = ahead.generate(reqs)
    assert ahead.core.pipelined > 0 and sorted(r.uid for r in out) == sorted(r.uid for r in reqs)
    for r in out:
        stopped = r.tokens[-1] in STOPS.stop_token_ids
        assert r.finish_reason == ("stop" if stopped else "length") and len(r.logprobs) == len(r.tokens)
        assert stopped or len(r.tokens) == STOPS.max_new_tokens
        assert not any(t in STOPS.stop_token_ids for t in r.tokens[:-1])


def test_a_padding_row_writes_only_the_sink_block():
    """After a padded step the zero block is still zeros (rows past their blocks read it as masked keys)."""
    from detrl.rollout.cuda_graphs import DecodeGraphs

    model, reqs = tiny_model("qwen3"), _requests(groups=1, n=3)
    with torch.no_grad():  # padding rows feed token 0, whose embedding (the pad id's) is zeros: not here
        model.model.embed_tokens.weight[0] = 1.0
    eng = CudaPagedEngine(model, DEFAULT_OPS, CTX, PARAMS, seed=3, device="cpu", max_batch_size=3,
                          pool=PoolSpec(block_size=4, prefill_chunk=8, kv_pool_tokens=64 * 4))  # fmt: skip
    graphs = DecodeGraphs(eng.weights, eng.ops, CTX, 4, eng.core.rope, 3, "cpu", capture=False)
    eng.core.decode = graphs
    seen = []
    write = eng.core.pool_type.write

    def spy(pool, layer, k, v, plan):
        write(pool, layer, k, v, plan)
        zero = pool.zero_slots()
        seen.append((bool(pool.k[layer][zero].any()), bool(pool.v[layer][zero].any()), len(plan.write)))

    eng.core.pool_type = type("Spied", (eng.core.pool_type,), {"write": spy})
    eng.generate(reqs)
    hkv = model.config.num_key_value_heads
    assert any(n == 4 * hkv for *_, n in seen)  # steps of 3 rows ran as 4
    assert not any(k or v for k, v, _ in seen)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_MODELS = {"dense": ModelConfig(init="random", vocab_size=512),
              "moe": ModelConfig(name="qwen3_moe", num_experts=4, num_experts_per_tok=2, init="random", vocab_size=512)}  # fmt: skip
GPU_CTX = 96


def _gpu_run(model, ops, reqs, **kw):
    eng = CudaPagedEngine(model, ops, GPU_CTX, PARAMS, seed=1, device="cuda", dtype=torch.bfloat16, **kw)
    return eng, eng.generate(reqs)


def _trainer_logprobs(model, ops, reqs, results):
    """The trainer's logprobs of each result's tokens: one whole-sequence pass over prompt + response."""
    from detrl.models.forward import rope_tables
    from detrl.models.logprobs import sequence_logprobs

    ids = torch.zeros(len(reqs), GPU_CTX, dtype=torch.long)
    mask = torch.zeros(len(reqs), GPU_CTX - 1)
    for i, (q, r) in enumerate(zip(reqs, results)):
        seq = list(q.prompt_ids) + r.tokens
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(q.prompt_ids) - 1 : len(seq) - 1] = 1
    rope = rope_tables(model.config, GPU_CTX, "cuda", torch.bfloat16)
    with torch.no_grad():
        tok, _ = sequence_logprobs(model, ids.cuda(), mask.cuda(), ops, GPU_CTX, rope, 1.0)
    trainer = [
        tok[i, len(q.prompt_ids) - 1 : len(q.prompt_ids) - 1 + len(r.tokens)].tolist()
        for i, (q, r) in enumerate(zip(reqs, results))
    ]
    return trainer


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("cfg", list(GPU_MODELS), ids=list(GPU_MODELS))
def test_gpu_on_logprobs_are_the_trainers_and_invariant_to_the_schedule(cfg):
    """The Triton op set in bf16, attention through the paged kernel: batch caps (3: many preemption-free
    schedules), arrival order and block size change no bit, and the trainer's logprobs equal the engine's."""
    from detrl.models.ops import CUDA_INVARIANT_OPS

    model = build_model(GPU_MODELS[cfg], seed=0).cuda()
    ops = dataclasses.replace(CUDA_INVARIANT_OPS, dtype=torch.bfloat16)
    reqs = _requests(groups=4, n=4)
    eng, ref = _gpu_run(model, ops, reqs)
    assert type(eng.core.pool).__name__ == "KernelPool"  # attention read the pool in place
    assert bits(_gpu_run(model, ops, reqs, max_batch_size=3)[1]) == bits(ref)
    assert bits(
        _gpu_run(model, ops, reqs, pool=dataclasses.replace(DEVICE_POOL, block_size=4, prefill_chunk=5))[1]
    ) == bits(ref)
    back = {r.uid: r for r in _gpu_run(model, ops, reqs[::-1])[1]}
    assert bits([back[r.uid] for r in ref]) == bits(ref)
    assert _trainer_logprobs(model, ops, reqs, ref) == [r.logprobs for r in ref]
    eager, out = _gpu_run(model, ops, reqs, graphs=False)
    assert eng.core.decode is not None and eng.core.decode.graphs and eager.core.decode is None
    assert bits(out) == bits(ref)  # the replayed decode steps are the eager ones, bit for bit
    assert eng.core.pipelined > 0  # ... with the host a step ahead, and without:
    assert bits(_gpu_run(model, ops, reqs, overlap=False)[1]) == bits(ref)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("chunk, top_p", [(1, 1.0), (512, 0.9)], ids=["chunk1", "top_p0.9"])
def test_gpu_graphs_keep_the_eager_bits_at_top_p_and_prefill_chunks_of_one(chunk, top_p):
    """Captured, the step's own draw at top_p < 1 (sort and cumsum inside the graph) and a prefill chunk of one
    token (mid-prompt rows: not a decode step) give the eager engine's bits; the trainer's logprobs too."""
    from detrl.models.ops import CUDA_INVARIANT_OPS

    model = build_model(GPU_MODELS["dense"], seed=0).cuda()
    ops = dataclasses.replace(CUDA_INVARIANT_OPS, dtype=torch.bfloat16)
    reqs = _requests(groups=4, n=4)
    params = dataclasses.replace(PARAMS, top_p=top_p, stop_token_ids=tuple(range(64)))  # lengths spread
    kw = dict(pool=dataclasses.replace(DEVICE_POOL, prefill_chunk=chunk))
    graphs = CudaPagedEngine(model, ops, GPU_CTX, params, seed=1, device="cuda", dtype=torch.bfloat16, **kw)
    eager = CudaPagedEngine(
        model, ops, GPU_CTX, params, seed=1, device="cuda", dtype=torch.bfloat16, graphs=False, **kw
    )
    got, ref = graphs.generate(reqs), eager.generate(reqs)
    assert graphs.core.decode.graphs and eager.core.decode is None and graphs.core.pipelined > 0
    assert bits(got) == bits(ref)
    assert min(len(r.tokens) for r in ref) < max(len(r.tokens) for r in ref)  # rows left at different steps
    assert _trainer_logprobs(model, ops, reqs, ref) == [r.logprobs for r in ref]


@pytest.mark.gpu
@cuda
def test_gpu_off_runs_sdpa_over_gathered_keys_close_to_the_trainer():
    from detrl.models.ops import CUDA_DEFAULT_OPS

    model = build_model(GPU_MODELS["dense"], seed=0).cuda()
    ops = dataclasses.replace(CUDA_DEFAULT_OPS, dtype=torch.bfloat16)
    reqs = _requests(groups=4, n=4, seeded=False)
    eng, out = _gpu_run(model, ops, reqs, fixed_routing=False)
    assert sorted(r.uid for r in out) == sorted(r.uid for r in reqs)
    # the keys gathered are the rows' slots only (a serving engine's read): the key length follows the batch
    assert type(eng.core.pool).__name__ == "LivePool" and eng.stat("hit_blocks") > 0
    by_uid = {r.uid: r for r in out}
    res = [by_uid[r.uid] for r in reqs]
    diff = torch.tensor(
        [a - b for t, r in zip(_trainer_logprobs(model, ops, reqs, res), res) for a, b in zip(t, r.logprobs)]
    )
    # not the trainer's bits (other kernels, other key lengths), but its numbers to bf16's precision
    assert diff.abs().max() < 0.1 and diff.abs().mean() < 0.02, (diff.abs().max(), diff.abs().mean())
