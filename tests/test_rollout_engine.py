"""The engine core under determinism=on: a sequence's bits do not depend on its schedule (bitwise, per source)."""

import pytest
import torch

from detrl.config import ModelConfig, RolloutConfig
from detrl.determinism import Determinism, preset
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, build_model
from detrl.models.forward import fuse
from detrl.rollout import EmbeddedEngine, Request, SamplingParams
from detrl.rollout.cuda_paged import CudaPagedEngine
from detrl.rollout.paged import KVPool, LivePool, PoolSpec, SeqBlocks, kv_token_bytes, pool_blocks, pool_for
from detrl.rollout.scheduler import EngineCore
from tests.rollout_helpers import EOS, group_requests, tiny_model

CTX = 48
PARAMS = SamplingParams(1.0, 1.0, 20, (EOS,))


def _weights(name):
    return fuse(tiny_model(name), None)


def _requests(groups=4, n=3):
    """Prompt groups of different lengths (5..26 tokens), n seeded samples each."""
    return group_requests(groups, n, lambda g: tuple(3 + (g * 7 + i) % 50 for i in range(5 + 7 * g)))


def _run(
    name, reqs, arrive=None, blocks=64, block_size=4, chunk=8, max_running=64, ops=BATCH_INVARIANT_OPS, **kw
):
    """Run requests through one core to the end; arrive[i]: the step request i is added at. -> {uid: bits}."""
    core = EngineCore(_weights(name), ops, CTX, blocks, block_size, chunk, max_running, **kw)
    arrive = arrive or [0] * len(reqs)
    out, step = {}, 0
    while len(out) < len(reqs):
        for i, r in enumerate(reqs):
            if arrive[i] == step:
                core.add(r.uid, r, PARAMS)
        for f in core.step():
            experts = None if f.routed_experts is None else f.routed_experts.tobytes()
            out[f.key] = (f.tokens, f.logprobs, f.finish_reason, experts)
        step += 1
    return out, core


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def reference(request):
    """Each request alone in a fresh core: no batch-mates, no cache hits, one chunk per prompt."""
    name, reqs = request.param, _requests()
    ref = {}
    for r in reqs:
        ref.update(_run(name, [r], chunk=CTX)[0])
    assert any(v[2] == "stop" for v in ref.values()) and any(len(v[0]) > 4 for v in ref.values())
    return name, reqs, ref


def test_batch_mates_and_batch_caps_change_no_bit(reference):
    name, reqs, ref = reference
    assert _run(name, reqs)[0] == ref
    assert _run(name, reqs, max_running=3)[0] == ref


def test_arrival_order_changes_no_bit(reference):
    name, reqs, ref = reference
    assert _run(name, reqs[::-1])[0] == ref
    assert _run(name, reqs, arrive=[(7 * i) % 11 for i in range(len(reqs))])[0] == ref


def test_chunk_boundaries_change_no_bit(reference):
    name, reqs, ref = reference
    for chunk in (1, 3, 5):
        assert _run(name, reqs, chunk=chunk)[0] == ref


def test_pool_size_preemption_and_block_layout_change_no_bit(reference):
    name, reqs, ref = reference
    small, core = _run(name, reqs, blocks=CTX // 4 + 2)  # two sequences' worth: preemption recomputes
    assert small == ref
    assert _run(name, reqs, block_size=8, blocks=40)[0] == ref
    assert _run(name, reqs, block_size=1, blocks=400)[0] == ref


def test_prefix_cache_hits_change_no_bit_and_save_prompt_blocks(reference):
    name, reqs, ref = reference
    hot, hot_core = _run(name, reqs, blocks=200)  # room for all: no preemption
    cold, cold_core = _run(name, reqs, blocks=200, prefix_cache=False)
    assert hot == ref and cold == ref
    assert (
        hot_core.computed_tokens < cold_core.computed_tokens
    )  # the prompts' shared blocks were not recomputed
    assert hot_core.manager.used_peak < cold_core.manager.used_peak


def test_a_continuation_reuses_its_blocks_and_matches_one_call():
    """A partial rollout cut at 6 tokens and continued finds its prompt + prefix blocks cached."""
    reqs = _requests(groups=2, n=2)
    whole = _run("qwen3", reqs)[0]
    core = EngineCore(_weights("qwen3"), BATCH_INVARIANT_OPS, CTX, 64, 4, 8, 64)
    for r in reqs:
        core.add(r.uid, Request(*r.uid, r.prompt_ids, r.seed, (), 6), PARAMS)
    first = {}
    while not core.idle():
        first.update({f.key: f for f in core.step()})
    before = core.computed_tokens
    for r in reqs:
        f = first[r.uid]
        if f.finish_reason == "abort":
            core.add(r.uid, Request(*r.uid, r.prompt_ids, r.seed, tuple(f.tokens)), PARAMS)
    cont = {}
    while not core.idle():
        cont.update({f.key: f for f in core.step()})
    assert cont, "no sample was cut at 6 tokens"
    for uid, f in cont.items():
        assert first[uid].tokens + f.tokens == whole[uid][0]
        assert first[uid].logprobs + f.logprobs == whole[uid][1]
    recomputed = core.computed_tokens - before - sum(len(f.tokens) for f in cont.values())
    assert recomputed < len(cont) * 4  # at most the last partial block of each context is prefilled again


def test_the_engine_matches_the_static_baseline_bitwise():
    model = tiny_model("qwen3_moe")
    reqs = _requests()
    out = {}
    for scheduler in ("static", "continuous"):
        eng = EmbeddedEngine(model, BATCH_INVARIANT_OPS, CTX, PARAMS, seed=0, num_workers=2, max_batch_size=5,
                             scheduler=scheduler, pool=PoolSpec(block_size=4, prefill_chunk=8))  # fmt: skip
        res = eng.generate(reqs)
        eng.close()
        out[scheduler] = [(r.tokens, r.logprobs, r.finish_reason, r.routed_experts.tobytes()) for r in res]
    assert out["static"] == out["continuous"]
    assert torch.tensor([len(t) for t, *_ in out["static"]]).unique().numel() > 1  # lengths vary


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_the_preflight_proves_the_paged_path_and_catches_a_chunk_dependent_attention(name):
    import dataclasses

    from detrl.models.forward import forward, rope_tables
    from detrl.models.ops import bi_attention
    from detrl.models.preflight import _logprobs_of, check_paged

    w = _weights(name)
    rope = rope_tables(w.config, CTX)
    ids = torch.randint(3, 64, (4, CTX), generator=torch.Generator().manual_seed(0))
    full = _logprobs_of(forward(w, ids, BATCH_INVARIANT_OPS, CTX, rope)[:, :-1], ids[:, 1:])
    assert check_paged(w, BATCH_INVARIANT_OPS, CTX, rope, ids, full, 5) == []

    def chunked_differs(q, k, v, mask, scale):  # a kernel whose rounding depends on the query block size
        out = bi_attention(q, k, v, mask, scale)
        return out if q.shape[2] in (1, CTX) else out * (1 + 2**-20)

    bad = dataclasses.replace(BATCH_INVARIANT_OPS, attention=chunked_differs)
    assert "paged chunked prefill" in check_paged(w, bad, CTX, rope, ids, full, 5)[0]


def test_calls_submitted_while_others_run_join_them_and_stream_back_in_completion_order():
    model = tiny_model("qwen3")
    reqs = _requests()
    eng = EmbeddedEngine(model, BATCH_INVARIANT_OPS, CTX, PARAMS, seed=0, num_workers=2, max_batch_size=8,
                         fixed_routing=False, pool=PoolSpec(block_size=4, prefill_chunk=8))  # fmt: skip
    alone = {r.uid: (r.tokens, r.logprobs) for r in eng.generate(reqs)}
    first = eng.submit(reqs[:6])
    stream = eng.results(first)
    got = [next(stream)]  # the first call is running ...
    second = eng.submit(reqs[6:], PARAMS)  # ... when the second joins it
    got += list(eng.results(second)) + list(stream)
    eng.close()
    assert sorted(r.uid for r in got) == sorted(alone)
    assert all((r.tokens, r.logprobs) == alone[r.uid] for r in got)


@pytest.mark.slow
def test_a_long_context_runs_with_the_kv_bounded_by_the_pool_cap():
    """max_new_tokens=2048, a prompt x 16 samples on the default shape: a static engine would hold 16 full
    contexts of KV; the automatic pool is capped by kv_pool_max_tokens (here 4 contexts per worker), the run
    completes and the peak KV stays within the cap's bytes."""
    model = build_model(ModelConfig(max_position_embeddings=2112), seed=0)
    det = Determinism(preset("on"), seed=0)
    params = SamplingParams(1.0, 1.0, 2048, (EOS,))
    reqs = [Request(g, j, (5 + g, 7, 9, 11), det.sampling_seed(1, g, j)) for g in range(1) for j in range(16)]
    ctx, cap = 2112, 4 * 2112
    eng = EmbeddedEngine(
        model, BATCH_INVARIANT_OPS, ctx, params, seed=0, num_workers=2, pool=PoolSpec(kv_pool_max_tokens=cap)
    )
    try:
        out = eng.generate(reqs)
        c = model.config
        cap_bytes = 2 * eng.num_workers * cap * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
        assert sorted(r.uid for r in out) == sorted(r.uid for r in reqs)
        assert all(r.finish_reason in ("stop", "length") for r in out)
        assert 0 < eng.stat("kv_bytes_peak") <= eng.stat("kv_pool_bytes") <= cap_bytes
        assert eng.stat("kv_pool_bytes") < 16 * ctx * cap_bytes // (
            eng.num_workers * cap
        )  # < static's caches
    finally:
        eng.close()


def test_the_schedule_is_a_source_only_with_the_default_kernels():
    """What determinism.routing=dynamic releases: the running batch's make-up (who joins when). With torch's
    default CPU kernels a sequence's bits depend on its batch-mates, so another arrival order or batch cap gives
    other logprobs for the same seeded requests; the batch-invariant kernels give the same bits (above)."""
    reqs = _requests()
    base = _run("qwen3", reqs, ops=DEFAULT_OPS)[0]
    other = [
        _run("qwen3", reqs[::-1], ops=DEFAULT_OPS)[0],
        _run("qwen3", reqs, ops=DEFAULT_OPS, max_running=3)[0],
        _run("qwen3", reqs, ops=DEFAULT_OPS, arrive=[(7 * i) % 11 for i in range(len(reqs))])[0],
    ]
    assert any(o != base for o in other)
    assert _run("qwen3", reqs[::-1])[0] == _run("qwen3", reqs)[0]


def test_pool_blocks_the_explicit_size_else_the_cap_within_half_the_free_memory():
    """One rule sizes both paged engines' pools (ctx 64, blocks of 16, 8 running: 8 contexts = 32 blocks)."""
    tb = kv_token_bytes(tiny_model("qwen3").config, 4)
    assert KVPool(tiny_model("qwen3").config, 3, 16, torch.float32, 64).block_bytes == 16 * tb
    assert pool_blocks(None, tb, 64, 16, 8, 320, 65536) == 20  # the explicit size, over the cap too
    assert pool_blocks(None, tb, 64, 16, 8, 0, 65536) == 32  # 8 full contexts
    assert pool_blocks(None, tb, 64, 16, 8, 0, 0) == 32  # cap 0: none
    assert pool_blocks(None, tb, 64, 16, 8, 0, 128) == 8  # the cap
    assert pool_blocks(None, tb, 64, 16, 8, 0, 16) == 4  # at least one context
    assert pool_blocks(2 * 160 * tb + 1, tb, 64, 16, 8, 0, 65536) == 10  # half the free memory: 160 tokens
    assert pool_blocks(2 * 160 * tb, tb, 64, 16, 8, 320, 0) == 10  # bounds an explicit size given free bytes
    assert pool_blocks(2 * 160 * tb - 1, tb, 64, 16, 8, 0, 65536) == 9  # whole tokens, then whole blocks
    assert pool_blocks(tb, tb, 64, 16, 8, 0, 65536) == 4  # little memory: still one context
    assert pool_blocks(None, tb, 63, 16, 8, 0, 20) == 4  # one context rounds up to whole blocks


def test_the_engines_size_their_pools_from_the_spec():
    """A run's config reaches the spec field by field; both engines build their pools with it (on CPU)."""
    rollout = RolloutConfig(block_size=4, prefill_chunk=5, kv_pool_tokens=96, kv_pool_max_tokens=7)
    assert PoolSpec.from_config(rollout) == PoolSpec(4, 5, 96, 7)
    spec, model = PoolSpec(block_size=16, prefill_chunk=8, kv_pool_tokens=320), tiny_model("qwen3")
    emb = EmbeddedEngine(model, BATCH_INVARIANT_OPS, 64, PARAMS, seed=0, max_batch_size=8, pool=spec)
    assert (emb.blocks, emb.block_size, emb.prefill_chunk) == (20, 16, 8)
    pag = CudaPagedEngine(model, BATCH_INVARIANT_OPS, 64, PARAMS, seed=0, max_batch_size=8, device="cpu")
    assert pag.core.num_blocks == 32  # its own default: 8 contexts within the cap of 65,536 tokens
    pag = CudaPagedEngine(model, BATCH_INVARIANT_OPS, 64, PARAMS, seed=0, device="cpu", pool=spec)
    assert (pag.core.num_blocks, pag.core.block_size, pag.core.chunk) == (20, 16, 8)


def test_the_gather_reads_the_rows_blocks_and_zeros_past_them_as_the_full_gather_does():
    """write_read gathers only the slots the widest row's blocks hold: a multi-token step's keys and values, in
    a reused buffer zero past them, equal gathering all ctx_len slots whatever the steps before (wider,
    narrower, more rows, fewer); a decode step's are the first W of those, W the admitted decode width that
    covers the rows' blocks (`decode_attention.decode_width`)."""
    from detrl.models.decode_attention import decode_width

    config, bs, blocks, ctx = tiny_model("qwen3").config, 4, 12, 40
    pool = KVPool(config, blocks, bs, torch.float32, ctx)
    g = torch.Generator().manual_seed(0)
    zero = pool.zero_slots()
    for layer in range(len(pool.k)):
        for t in (pool.k[layer], pool.v[layer]):
            t.copy_(torch.randn(t.shape, generator=g))
            t[zero] = 0  # the zero block: what slots past a row's blocks read
    for tables in ([[0, 1], [2, 3, 4, 5, 6], [7]], [[8], [9]], [[0, 1, 2, 3, 4, 5], [6, 7], [8], [9, 10]],
                   [[1]], [list(range(10))], [[3], [4, 5]]):  # fmt: skip
        table = pool.table(tables)
        slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :ctx]  # [B, ctx_len]
        full = (slots[:, None, :] + pool._heads[None, :, None]).reshape(-1)
        b, d, held = len(tables), config.head_dim, min(ctx, bs * max(map(len, tables)))
        for t, width in ((2, ctx), (1, decode_width(d, ctx, torch.float32, "cpu", held))):
            k = v = torch.zeros(b, pool.hkv, t, d)
            plan = pool.plan(torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.bool), table)
            assert plan[3] == (held if t > 1 else width) and held <= width
            for layer in range(len(pool.k)):
                keys, values = pool.write_read(layer, k, v, plan)
                every = [
                    x.index_select(0, full).view(b, pool.hkv, ctx, d) for x in (pool.k[layer], pool.v[layer])
                ]
                assert torch.equal(keys, every[0][:, :, :width]) and torch.equal(
                    values, every[1][:, :, :width]
                )


def test_a_sequences_kept_table_row_follows_its_growing_block_table():
    """`KVPool.tables` stacks each sequence's kept padded row (`SeqBlocks.padded`), synced with the blocks appended
    since the last step: always the table's ids, then the zero block's."""
    pool = KVPool(tiny_model("qwen3").config, 12, 4, torch.float32, 40)  # 10 blocks a row
    seqs = [SeqBlocks([3]), SeqBlocks(), SeqBlocks([0, 1, 2])]
    for bid in (4, 5, 6, 7, 8, 9, 10, 11):
        for s in seqs[: 1 + bid % 3]:
            s.table.append(bid)
        assert torch.equal(pool.tables(seqs), pool.table([list(s.table) for s in seqs]))
    assert pool.tables(seqs)[1].tolist() == [4, 5, 7, 8, 10, 11] + [12] * 4


def test_the_default_kernels_read_the_rows_slots_only_and_attend_as_over_ctx_len():
    """Under torch's SDPA (determinism off) the engine reads as a serving engine does: keys [B, Hkv, W, D] for the
    W slots the widest row holds, not ctx_len; the attention agrees with the fixed-length one to rounding."""
    assert pool_for(DEFAULT_OPS) is LivePool and pool_for(BATCH_INVARIANT_OPS) is KVPool
    assert type(_run("qwen3", _requests(1, 2), ops=DEFAULT_OPS)[1].pool) is LivePool
    config, bs, ctx = tiny_model("qwen3").config, 4, 40
    pools = [cls(config, 12, bs, torch.float32, ctx) for cls in (KVPool, LivePool)]
    g = torch.Generator().manual_seed(0)
    tables, t, d = [[0, 1], [2, 3, 4], [5]], 3, config.head_dim
    table = pools[0].table(tables)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11], [1, 2, 3]])
    valid = torch.ones(3, t, dtype=torch.bool)
    k, v = (torch.randn(3, pools[0].hkv, t, d, generator=g) for _ in range(2))
    q = torch.randn(3, config.num_attention_heads, t, d, generator=g)
    zero = pools[0].zero_slots()
    out = []
    for pool in pools:  # the same random pool contents in both, the zero block kept zero
        for i, kv in enumerate((pool.k[0], pool.v[0])):
            kv.normal_(generator=torch.Generator().manual_seed(i))[zero] = 0
        plan = pool.plan(pool.token_slots(table, positions), valid, table)
        keys, values = pool.write_read(0, k, v, plan)
        mask = pool.mask(positions, table, plan)
        out.append(DEFAULT_OPS.attention(q, keys, values, mask, d**-0.5))
        assert keys.shape[2] == mask.shape[-1] == (ctx if pool is pools[0] else 3 * bs)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-6)


def test_decodes_cut_to_narrower_key_widths_keep_the_trainers_logprobs(monkeypatch):
    """ctx_len 608: decode steps attend over the admitted width that covers their keys (decode_attention.decode_widths), not
    all 608; responses of 300 tokens after prompts of 40 and 250 cross several widths (and the 576 blocking
    boundary of the full call), and every logprob equals the trainer's forward over ctx_len, bitwise."""
    from detrl.models import decode_attention as da
    from detrl.models.forward import rope_tables
    from detrl.models.preflight import _trainer_logprobs

    ctx, new = 608, 300
    model = build_model(ModelConfig(max_position_embeddings=ctx), seed=0)
    weights, used = fuse(model, None), set()
    width = da.decode_width
    monkeypatch.setattr(da, "decode_width", lambda *a: used.add(width(*a)) or width(*a))
    prompts = [tuple(3 + (i * 5) % 60 for i in range(p)) for p in (40, 250)]
    reqs = [Request(g, 0, p, 11 + g) for g, p in enumerate(prompts)]
    core = EngineCore(weights, BATCH_INVARIANT_OPS, ctx, 2 * ctx // 16, 16, 64, 8)
    for r in reqs:
        core.add(r.uid, r, SamplingParams(1.0, 1.0, new, ()))
    done = {}
    while len(done) < len(reqs):
        done.update({f.key: f for f in core.step()})
    widths = da.decode_widths(model.config.head_dim, ctx, torch.float32)
    assert len(used & set(widths[:-1])) >= 3  # several narrower widths ran
    ids = torch.zeros(len(reqs), ctx, dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, : len(r.prompt_ids) + new] = torch.tensor(r.prompt_ids + tuple(done[r.uid].tokens))
    with torch.no_grad():
        full = _trainer_logprobs(weights, ids, BATCH_INVARIANT_OPS, ctx, rope_tables(model.config, ctx))
    for i, r in enumerate(reqs):
        p = len(r.prompt_ids)
        assert torch.equal(torch.tensor(done[r.uid].logprobs), full[i, p - 1 : p - 1 + new]), i


# chunks of 16 positions; a vocab too large to buffer (the buffer's cap lowered: a real vocab's path, 2,000x smaller)
@pytest.mark.parametrize("vocab,cap", [(64, 2**22), (512, 2**10)])
def test_seeded_noise_in_chunks_is_each_positions_hash_as_rows_join_and_leave(vocab, cap, monkeypatch):
    from detrl.rollout import sampling
    from detrl.rollout.sampling import hashed_gumbel
    from detrl.rollout.scheduler import SeededNoise, Sequence

    monkeypatch.setattr(sampling, "NOISE_ELEMENTS", cap)
    params = SamplingParams(1.0, 1.0, 40, ())
    noise = SeededNoise(4, vocab)
    assert noise.chunk == (16 if vocab == 64 else 1)

    def seq(seed: int, prompt: int, limit: int) -> Sequence:
        ctx = list(range(prompt))
        return Sequence(seed, Request(seed, 0, tuple(ctx), seed=seed), params, ctx, prompt, limit, limit)

    running, pending = [seq(1, 3, 40)], [seq(2, 7, 5), seq(3, 2, 40), seq(4, 5, 30), seq(5, 4, 20)]
    for step in range(30):
        if step % 4 == 1 and pending and len(running) < 4:
            running.append(pending.pop(0))  # join mid-run, at its own position
        got = noise.take(running)
        want = hashed_gumbel(
            torch.tensor([s.request.seed for s in running]),
            torch.tensor([len(s.tokens) for s in running]),
            vocab,
        )
        assert torch.equal(got, want), step
        for s in running:
            s.tokens.append(0)
        for s in [s for s in running if len(s.sampled) >= s.limit or (step == 9 and s.key == 1)]:
            running.remove(s)  # finished (or preempted: back to waiting, its buffer row freed)
            noise.drop(s)
            if step == 9 and s.key == 1:
                pending.append(s)
    assert sorted(noise.free + [s.noise[0] for s in running if s.noise]) == list(range(4))


@pytest.mark.parametrize("vocab", [64, 151_936])  # the buffered path, and Qwen3's vocab (one position a call)
def test_seeded_noise_is_hashed_on_the_cores_device(vocab):
    """The noise lives where the logits are: on a GPU a [rows, V] float64 tensor per step hashed on the host and
    copied over took most of a decode step (docs/gpu/2026-12-07.md). "meta" stands in for the device on CPU."""
    from detrl.rollout.scheduler import SeededNoise, Sequence

    noise = SeededNoise(2, vocab, "meta")
    rows = [Sequence(k, Request(k, 0, (1, 2), seed=k), PARAMS, [1, 2], 2, 8, 8) for k in (1, 2)]
    got = noise.take(rows)
    assert got.device.type == "meta" and got.shape == (2, vocab) and got.dtype == torch.float64


def test_release_frees_the_pool_and_the_noise_buffer_and_the_next_rollout_has_the_same_bits():
    reqs = _requests(2, 3)
    first, core = _run("qwen3", reqs)
    assert core.pool is not None and core.seeded.buf is not None
    core.release()
    assert core.pool is None and core.seeded.buf is None and core.stats()["hit_blocks"] == 0
    for r in reqs:
        core.add(r.uid, r, PARAMS)
    again = {}
    while not core.idle():
        again.update({f.key: (f.tokens, f.logprobs, f.finish_reason, None) for f in core.step()})
    assert again == first
