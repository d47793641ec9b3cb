import pytest
import torch

from detrl.config import ModelConfig
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, KVCache, build_model, forward
from detrl.models.forward import rope_tables
from detrl.models.ops import bi_linear, route

L = 16


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request):
    return build_model(ModelConfig(name=request.param), seed=0).eval()


def _tokens(b=6, seed=0):
    return torch.randint(3, 64, (b, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ops", [DEFAULT_OPS, BATCH_INVARIANT_OPS], ids=lambda o: o.name)
def test_functional_forward_matches_transformers(model, ops):
    tok = _tokens()
    with torch.no_grad():
        ref = model(tok).logits
        out = forward(model, tok, ops, L, rope_tables(model.config, L))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@torch.no_grad()
def test_batch_invariant_ops_give_the_same_bits_whatever_the_batch(model):
    ops, rope = BATCH_INVARIANT_OPS, rope_tables(model.config, L)
    tok = _tokens()
    full = forward(model, tok, ops, L, rope)
    alone = forward(model, tok[3:4], ops, L, rope)  # batch of one
    mates = forward(model, torch.cat([_tokens(4, seed=9), tok[3:4]]), ops, L, rope)[-1:]  # other batch-mates
    assert torch.equal(alone, full[3:4])
    assert torch.equal(mates, full[3:4])


@torch.no_grad()
def test_prefill_plus_kv_cache_decode_equals_the_full_pass_bitwise(model):
    ops, rope = BATCH_INVARIANT_OPS, rope_tables(model.config, L)
    tok = _tokens(3)
    full = forward(model, tok, ops, L, rope)
    cache = KVCache.empty(model.config, 3, L)
    steps = [forward(model, tok[:, :5], ops, L, rope, cache=cache)]
    for t in range(5, L):
        steps.append(
            forward(model, tok[:, t : t + 1], ops, L, rope, cache=cache, positions=torch.full((3, 1), t))
        )
    assert torch.equal(torch.cat(steps, 1), full)


def test_default_matmul_is_not_row_invariant_but_ours_is():
    # the measured fact that motivates bi_linear: short calls (fewer than 12 rows on torch 2.13 CPU) take
    # other CPU kernels than a 64-row call
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=g), torch.randn(384, 128, generator=g)
    assert any(not torch.equal(x[:m] @ w.t(), (x @ w.t())[:m]) for m in (1, 2, 3, 5))
    assert all(torch.equal(bi_linear(x[:m], w), bi_linear(x, w)[:m]) for m in (1, 2, 3, 5, 17))


@pytest.mark.parametrize("k, n", [(2048, 768), (1536, 512), (128, 256)])
def test_linear_rows_at_two_threads_have_the_rollout_workers_one_thread_bits(k, n):
    # a trainer runs at every core, the rollout workers at one thread: under `on` a row's bits must be the same
    # in both and at any row count, also for shapes whose gemm splits K over threads at some row counts (on a
    # 2-core Xeon: K=2048, N=768 at <= 256 rows; K=1536, N=512 at 64..192 rows)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(600, k, generator=g), torch.randn(n, k, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = bi_linear(x, w)
        torch.set_num_threads(2)
        rows = {m: bi_linear(x[:m], w) for m in (1, 16, 40, 64, 128, 200, 256, 257, 600)}
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, ref[:m]) for m, out in rows.items()), [
        m for m, out in rows.items() if not torch.equal(out, ref[:m])
    ]


def test_routing_ties_go_to_the_lowest_expert_id():
    w, i = route(torch.tensor([[0.0, 1.0, 1.0, 1.0]]), top_k=2, norm_topk_prob=True)
    assert i.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]))


def test_load_from_a_local_checkpoint(tmp_path, model):
    model.save_pretrained(tmp_path)
    again = build_model(ModelConfig(name="qwen3", path=str(tmp_path)), seed=123)
    for (n, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), n
