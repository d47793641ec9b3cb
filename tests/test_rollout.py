import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.config import ModelConfig
from detrl.determinism import Determinism, preset
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, build_model
from detrl.rollout import EmbeddedEngine, Request, SamplingParams
from detrl.rollout.batching import fixed_batches as _fixed_batches
from detrl.rollout.sampling import hashed_uniform, top_p_mask

EOS = 2
CTX = 16


def _engine(ops=BATCH_INVARIANT_OPS, name="qwen3", **kw):
    params = SamplingParams(
        **{"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "stop_token_ids": (EOS,), **kw}
    )
    return EmbeddedEngine(build_model(ModelConfig(name=name), seed=0), ops, CTX, params, seed=0)


def _requests(n, seeded=True, prompt_len=5):
    det = Determinism(preset("on"), seed=0)
    out = []
    for i in range(n):
        ids = tuple(range(3, 3 + prompt_len - (i % 3)))
        out.append(Request(i // 2, i % 2, ids, det.sampling_seed(1, i // 2, i % 2) if seeded else None))
    return out


def test_sampler_outputs_are_well_formed():
    res = _engine().generate(_requests(12))
    assert len(res) == 12
    for r in res:
        assert 1 <= len(r.tokens) <= 8 and len(r.logprobs) == len(r.tokens)
        assert all(0 <= t < 64 for t in r.tokens)
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert r.finish_reason in ("stop", "length")


def test_stop_token_ends_the_response():
    stops = tuple(range(0, 64, 3))  # a third of the vocab stops
    res = _engine(stop_token_ids=stops).generate(_requests(16))
    for r in res:
        assert all(t not in stops for t in r.tokens[:-1])  # nothing after a stop token
        assert (r.finish_reason == "stop") == (r.tokens[-1] in stops)
    assert any(r.finish_reason == "stop" and len(r.tokens) < 8 for r in res)
    every = _engine(stop_token_ids=tuple(range(64))).generate(_requests(4))
    assert all(len(r.tokens) == 1 and r.finish_reason == "stop" for r in every)


def test_length_finish_without_a_stop_token():
    res = _engine(stop_token_ids=()).generate(_requests(4))
    assert all(len(r.tokens) == 8 and r.finish_reason == "length" for r in res)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_seeded_sample_does_not_depend_on_its_batch_mates(name):
    eng = _engine(name=name)
    reqs = _requests(10)
    together = {r.uid: (r.tokens, r.logprobs) for r in eng.generate(reqs)}
    alone = {r.uid: (r.tokens, r.logprobs) for r in eng.generate([reqs[7]])}
    reordered = {r.uid: (r.tokens, r.logprobs) for r in eng.generate(reqs[::-1][:6])}
    assert alone[reqs[7].uid] == together[reqs[7].uid]
    assert all(reordered[u] == together[u] for u in reordered)


def test_unseeded_requests_draw_from_the_shared_stream():
    eng = _engine(ops=DEFAULT_OPS)
    first = [r.tokens for r in eng.generate(_requests(8, seeded=False))]
    second = [r.tokens for r in eng.generate(_requests(8, seeded=False))]
    assert first != second  # the stream advanced: same prompts, new draws


def test_hashed_uniform_is_in_the_open_unit_interval_and_position_dependent():
    u = hashed_uniform(torch.tensor([1, 1, 2**62]), torch.tensor([5, 6, 5]), 64)
    assert bool(((u > 0) & (u < 1)).all())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (
        abs(hashed_uniform(torch.arange(200), torch.zeros(200, dtype=torch.long), 64).mean().item() - 0.5)
        < 0.01
    )


def test_top_p_keeps_the_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert top_p_mask(logp, 0.7).tolist() == [[True, True, False, False]]
    assert top_p_mask(logp, 1e-6).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_worker_routing_and_batch_size_do_not_change_seeded_samples(name):
    model = build_model(ModelConfig(name=name), seed=0)
    params = SamplingParams(1.0, 1.0, 8, (EOS,))
    reqs = _requests(24)
    layouts = [
        dict(num_workers=1, max_batch_size=64, fixed_routing=True),
        dict(num_workers=3, max_batch_size=5, fixed_routing=True),
        dict(num_workers=2, max_batch_size=3, fixed_routing=False),
    ]  # dynamic batches, same ops + seeds
    outs = []
    for kw in layouts:
        eng = EmbeddedEngine(model, BATCH_INVARIANT_OPS, CTX, params, seed=0, **kw)
        outs.append({r.uid: (r.tokens, r.logprobs) for r in eng.generate(reqs)})
        assert {w for w, _ in eng.batch_log} == set(range(kw["num_workers"]))  # every worker served
    assert outs[0] == outs[1] == outs[2]


def test_fixed_routing_returns_request_order_and_batches_deterministically():
    eng = EmbeddedEngine(
        build_model(ModelConfig(), seed=0),
        BATCH_INVARIANT_OPS,
        CTX,
        SamplingParams(max_new_tokens=3),
        seed=0,
        num_workers=3,
        max_batch_size=4,
        fixed_routing=True,
    )
    reqs = _requests(20)
    res = eng.generate(reqs)
    assert [r.uid for r in res] == [r.uid for r in reqs]
    first = sorted(eng.batch_log)
    eng.generate(reqs)
    assert sorted(eng.batch_log) == first  # the same batches on the same workers


def test_dynamic_engine_serves_every_request_once():
    eng = EmbeddedEngine(
        build_model(ModelConfig(), seed=0),
        DEFAULT_OPS,
        CTX,
        SamplingParams(max_new_tokens=3),
        seed=0,
        num_workers=2,
        max_batch_size=5,
        fixed_routing=False,
    )
    reqs = _requests(30, seeded=False)
    res = eng.generate(reqs)
    assert sorted(r.uid for r in res) == sorted(r.uid for r in reqs)
    served = [u for _, uids in eng.batch_log for u in uids]
    assert sorted(served) == sorted(r.uid for r in reqs)
    assert all(1 <= len(uids) <= 5 for _, uids in eng.batch_log)


def test_shared_stream_gives_identical_requests_different_samples():
    eng = _engine(ops=DEFAULT_OPS)
    same = [Request(0, i, (3, 4, 5, 6)) for i in range(6)]
    assert len({tuple(r.tokens) for r in eng.generate(same)}) > 1


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_cut_and_continued_sample_equals_an_uncut_one(name):
    """Partial rollout under on: generate 1 token at a time, carrying the prefix, gives the uncut bits."""
    eng = _engine(name=name)
    reqs = _requests(6)
    whole = {r.uid: (r.tokens, r.logprobs, r.finish_reason) for r in eng.generate(reqs)}
    pieces = {r.uid: ([], [], "abort") for r in reqs}
    pending = list(reqs)
    while pending:
        results = eng.generate(
            [
                Request(r.prompt_uid, r.sample_index, r.prompt_ids, r.seed, tuple(pieces[r.uid][0]), 1)
                for r in pending
            ]
        )
        for res in results:
            toks, lps, _ = pieces[res.uid]
            pieces[res.uid] = (toks + res.tokens, lps + res.logprobs, res.finish_reason)
        pending = [r for r in pending if pieces[r.uid][2] == "abort"]
    assert pieces == whole


def test_dynamic_engine_cut_returns_partial_and_unstarted_requests_as_abort():
    eng = EmbeddedEngine(
        build_model(ModelConfig(), seed=0),
        DEFAULT_OPS,
        CTX,
        SamplingParams(max_new_tokens=8),
        seed=0,
        num_workers=1,
        max_batch_size=2,
        fixed_routing=False,
    )
    res = eng.generate(_requests(10, seeded=False), stop_when=lambda done: len(done) >= 2)
    assert len(res) == 10
    assert sum(r.finish_reason != "abort" for r in res) >= 2
    assert any(r.finish_reason == "abort" and not r.tokens for r in res)  # never started


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), workers=st.integers(1, 4), cap=st.integers(1, 70))
def test_the_fixed_rule_cuts_near_equal_batches_that_keep_every_worker_busy(n, workers, cap):
    batches = _fixed_batches(list(range(n)), workers, cap)
    sizes = [len(b) for b in batches]
    assert [x for b in batches for x in b] == list(range(n))  # submission order, every item once
    assert max(sizes) <= cap and max(sizes) - min(sizes) <= 1
    assert (
        len(batches) % workers == 0 or len(batches) == n
    )  # whole rounds over the workers (or one item each)
    assert len(batches) < -(-n // cap) + workers  # no more rounds than the cap needs


def test_workers_see_each_weight_sync_and_a_dead_worker_is_replaced():
    """The workers read the weights from shared memory: after update_weights they sample from the new
    policy, bit for bit what a fresh engine on that policy samples; a killed worker is restarted."""
    params = SamplingParams(1.0, 1.0, 8, (EOS,))
    first, second = build_model(ModelConfig(), seed=0), build_model(ModelConfig(), seed=1)
    reqs = _requests(12)
    eng = EmbeddedEngine(first, BATCH_INVARIANT_OPS, CTX, params, seed=0, num_workers=2, max_batch_size=4)
    before = [(r.tokens, r.logprobs) for r in eng.generate(reqs)]
    eng.update_weights(second.state_dict())
    after = [(r.tokens, r.logprobs) for r in eng.generate(reqs)]
    fresh = EmbeddedEngine(second, BATCH_INVARIANT_OPS, CTX, params, seed=0, num_workers=1)
    assert after == [(r.tokens, r.logprobs) for r in fresh.generate(reqs)] != before
    eng._procs[0].kill()
    eng._procs[0].join()
    assert [(r.tokens, r.logprobs) for r in eng.generate(reqs)] == after
    procs = eng._procs
    eng.close()
    fresh.close()
    assert not any(p.is_alive() for p in procs)


def test_a_request_too_long_for_the_context_fails_in_the_caller_with_one_line():
    eng = _engine()
    with pytest.raises(ValueError, match="exceeds ctx_len=16"):
        eng.generate([Request(0, 0, tuple(range(3, 13)), 1)])
