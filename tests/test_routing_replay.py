"""MoE routing replay (R3): the engine records each sampled token's expert ids, the trainer can replay them, and
`mismatch/router_agreement` measures how often its own routing agrees."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from detrl.algos.routing import layer_agreement
from detrl.collect import Scored, to_tensors
from detrl.config import ConfigError, ModelConfig
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, build_model
from detrl.models.forward import forward, rope_tables
from detrl.models.logprobs import sequence_logprobs
from detrl.models.ops import moe_dispatch, route, route_topk, routing_weights
from detrl.rollout import EmbeddedEngine, SamplingParams
from detrl.rollout.partial import Sample
from tests.conftest import make_cfg, run_tiny
from tests.test_rollout import EOS, _requests
from tests.test_update import _batch, _Recorder

CTX = 16
MOE = ModelConfig(name="qwen3_moe")  # 2 layers, 4 experts, top 2


def _spy(ops, calls):
    """ops whose MoE dispatch records the expert ids it is given (one call per layer per forward)."""

    def moe(x, top_w, top_i, *rest):
        calls.append(top_i.clone())
        return moe_dispatch(x, top_w, top_i, *rest)

    return dataclasses.replace(ops, moe=moe)


def test_replay_weights_by_hand():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # softmax: [0.1, 0.2, 0.3, 0.4]
    ids = torch.tensor([[3, 0]])  # replayed experts, not the router's top 2 (3, 2)
    torch.testing.assert_close(
        routing_weights(logits, ids, False), torch.tensor([[0.4, 0.1]]), rtol=0, atol=1e-7
    )
    torch.testing.assert_close(
        routing_weights(logits, ids, True), torch.tensor([[0.8, 0.2]]), rtol=0, atol=1e-7
    )
    w, i = route(logits, 2, True)
    assert i.tolist() == [[3, 2]]
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7]]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("fn", [route, route_topk])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_replaying_the_routers_own_ids_gives_its_weights_bitwise(fn, k, dtype, norm):
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(k)).to(dtype)
    w, ids = fn(logits, k, norm)
    assert torch.equal(routing_weights(logits, ids, norm), w)


def test_layer_agreement_compares_id_sets_per_layer():
    trainer = torch.tensor([[[1, 3], [0, 2]], [[1, 2], [3, 0]]])  # [tokens=2, layers=2, k=2]
    rollout = torch.tensor([[[3, 1], [0, 1]], [[1, 2], [0, 3]]], dtype=torch.int16)
    assert layer_agreement(trainer, rollout).tolist() == [0.5, 1.0]


def test_forward_uses_the_forced_ids_where_given_and_its_own_elsewhere():
    model = build_model(MOE, seed=0)
    rope = rope_tables(model.config, CTX)
    ids = torch.randint(3, 64, (3, CTX), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, own = forward(model, ids, BATCH_INVARIANT_OPS, CTX, rope, routes=True)  # own [3, L, 2, 2]
        assert own.shape == (3, CTX, 2, 2)
        assert torch.equal(forward(model, ids, BATCH_INVARIANT_OPS, CTX, rope, experts=own), logits)
        forced = torch.full_like(own, -1)
        forced[:, 5:] = (own[:, 5:] + 1) % 4  # from position 5 on, another pair of experts than the router's
        calls = []
        replayed = forward(model, ids, _spy(BATCH_INVARIANT_OPS, calls), CTX, rope, experts=forced)
    for layer, used in enumerate(calls):
        used = used.view(3, CTX, 2)
        assert torch.equal(used[:, 5:], forced[:, 5:, layer])
        assert torch.equal(
            used[:, :5], own[:, :5, layer]
        )  # causal: positions before 5 route as without replay
    assert torch.equal(replayed[:, :5], logits[:, :5]) and not torch.equal(replayed[:, 5:], logits[:, 5:])


def _moe_engine(**kw):
    return EmbeddedEngine(
        build_model(MOE, seed=0),
        BATCH_INVARIANT_OPS,
        CTX,
        SamplingParams(1.0, 1.0, 6, (EOS,)),
        seed=0,
        num_workers=2,
        max_batch_size=4,
        **kw,
    )


def test_engine_records_the_routing_the_trainer_reproduces_under_on():
    eng = _moe_engine()
    results = eng.generate(_requests(8))
    for r in results:
        assert r.routed_experts.dtype == np.int16 and r.routed_experts.shape == (len(r.tokens), 2, 2)
    batch = to_tensors([Scored(results, torch.zeros(8), torch.zeros(8))], CTX, version=0)
    m = batch.mask > 0
    assert bool((batch.routed_experts[~m] == -1).all())
    rope = rope_tables(eng.config, CTX)
    with torch.no_grad():
        logp, _, own = sequence_logprobs(
            eng.weights, batch.input_ids, batch.mask, BATCH_INVARIANT_OPS, CTX, rope, 1.0, routes=True
        )
        replayed, _ = sequence_logprobs(
            eng.weights,
            batch.input_ids,
            batch.mask,
            BATCH_INVARIANT_OPS,
            CTX,
            rope,
            1.0,
            experts=batch.routed_experts.long(),
        )
    assert torch.equal(own[m], batch.routed_experts[m].long())  # the same ids, in the same slot order
    assert float(layer_agreement(own, batch.routed_experts)[m].mean()) == 1.0
    assert torch.equal(logp, batch.rollout_logp) and torch.equal(replayed, logp)
    dense = EmbeddedEngine(
        build_model(ModelConfig(), seed=0), BATCH_INVARIANT_OPS, CTX, SamplingParams(), seed=0
    )
    assert all(r.routed_experts is None for r in dense.generate(_requests(2)))
    assert (
        to_tensors(
            [Scored(dense.generate(_requests(2)), torch.zeros(2), torch.zeros(2))], CTX, 0
        ).routed_experts
        is None
    )


def test_partial_continuations_keep_the_ids_aligned_with_the_tokens():
    eng = _moe_engine()
    reqs = _requests(6)
    whole = {r.uid: r for r in eng.generate(reqs)}
    samples = {r.uid: Sample(r) for r in reqs}
    calls = 0
    while pending := [s for s in samples.values() if s.finish is None]:  # one token per call
        for res in eng.generate([s.continuation(1) for s in pending]):
            samples[res.uid].absorb(res, version=calls)
        calls += 1
    assert calls >= 4  # several continuations
    for uid, s in samples.items():
        r = s.as_result()
        assert r.tokens == whole[uid].tokens
        assert np.array_equal(r.routed_experts, whole[uid].routed_experts)
    s.restart()
    assert s.routed_experts is None and s.as_result().routed_experts is None


def _replay_update(replay: bool):
    from tests.actor_helpers import update

    cfg = make_cfg(
        "model=qwen3_moe",
        "train_batch_size=2",
        "rollout.n=4",
        "algo.ppo_mini_batch_size=0",
        "algo.use_kl_loss=false",
        f"algo.routing_replay={str(replay).lower()}",
    )
    model = build_model(MOE, seed=0)
    batch, adv = _batch()
    g = torch.Generator().manual_seed(3)
    n, length = batch.mask.shape
    recorded = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n * length * 2)]).view(
        n, length, 2, 2
    )
    batch.routed_experts = torch.where(batch.mask[..., None, None] > 0, recorded, -1).to(torch.int16)
    calls = []
    m = update(
        model,
        None,
        _Recorder(model.parameters()),
        batch,
        adv,
        cfg,
        _spy(BATCH_INVARIANT_OPS, calls),
        CTX,
        rope_tables(model.config, CTX),
        version=0,
    )
    assert len(calls) == 2 * 2  # the old pass and one gradient pass, 2 layers each
    mask = batch.mask > 0
    used = [c.view(n, CTX, 2)[:, :-1][mask] for c in calls]
    return m, used, [batch.routed_experts[:, :, i % 2][mask].long() for i in range(len(calls))]


def test_update_replays_the_recorded_ids_in_the_old_and_gradient_passes():
    m, used, recorded = _replay_update(replay=True)
    assert all(torch.equal(u, r) for u, r in zip(used, recorded))
    # the recorded ids are random: the router's own choice agrees on some slots only (not vacuous)
    assert 0.0 < m["mismatch/router_agreement"] < 1.0
    _, used_off, _ = _replay_update(replay=False)
    assert not any(torch.equal(u, r) for u, r in zip(used_off, recorded))  # without replay: the router's own


def test_train_on_agreement_is_exactly_one_and_replay_changes_no_bit(tmp_path):
    plain = run_tiny(tmp_path / "plain", "model=qwen3_moe")
    replay = run_tiny(tmp_path / "replay", "model=qwen3_moe", "algo.routing_replay=true")
    for rows in (plain, replay):
        assert [r["mismatch/router_agreement"] for r in rows] == [1.0] * len(rows)
        assert all(r["mismatch/train_rollout_logprob_abs_diff"] == 0.0 for r in rows)
    for key in ("fp/params", "fp/rollout_tokens", "fp/rollout_logprobs"):
        assert [r[key] for r in plain] == [r[key] for r in replay], key


def test_train_partial_rollout_with_replay_on(tmp_path):
    rows = run_tiny(
        tmp_path,
        "model=qwen3_moe",
        "algo.routing_replay=true",
        "rollout.partial.enabled=true",
        "rollout.max_new_tokens=6",
    )
    assert any(r["partial/carried"] > 0 for r in rows)  # continuations reached the trainer
    assert all(
        r["mismatch/router_agreement"] == 1.0 and r["mismatch/train_rollout_logprob_abs_diff"] == 0.0
        for r in rows
    )


def test_train_off_logs_the_agreement_of_the_routers_own_choice(tmp_path):
    """determinism=off without replay: the metric is the router's own choice against the engine's (measured 1.0
    on CPU in float32, where batch variance ~1e-7 never flipped a top-k choice; < 1 is hand-checked in
    test_layer_agreement_compares_id_sets_per_layer)."""
    rows = run_tiny(tmp_path, "model=qwen3_moe", "determinism=off")
    values = [r["mismatch/router_agreement"] for r in rows]
    assert all(0.0 <= v <= 1.0 and not math.isnan(v) for v in values)
    dense = run_tiny(tmp_path / "dense", "steps=1")
    assert "mismatch/router_agreement" not in dense[0]  # dense: no routing to compare


@pytest.mark.parametrize(
    ("overrides", "msg"),
    [
        ((), r"algo.routing_replay=True is not valid: model=qwen3 is dense"),
        (
            ("model=qwen3_moe", "rollout=sglang"),
            r"algo.routing_replay=True is not valid: rollout=sglang does not record",
        ),
    ],
)
def test_replay_without_recorded_routing_is_refused_in_one_line(overrides, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        make_cfg("algo.routing_replay=true", *overrides)
    assert "\n" not in str(e.value)


def test_default_ops_replay_makes_the_trainer_use_the_rollouts_ids():
    """Under off the router may choose otherwise; replay forces the engine's ids whatever it chooses."""
    model = build_model(MOE, seed=0)
    rope = rope_tables(model.config, CTX)
    ids = torch.randint(3, 64, (2, CTX), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, own = forward(model, ids, DEFAULT_OPS, CTX, rope, routes=True)
        forced = (own + 1) % 4
        calls = []
        forward(model, ids, _spy(DEFAULT_OPS, calls), CTX, rope, experts=forced)
    assert all(torch.equal(c.view(2, CTX, 2), forced[:, :, i]) for i, c in enumerate(calls))


def test_replay_under_activation_checkpointing_same_gradients():
    model = build_model(MOE, seed=0)
    rope = rope_tables(model.config, CTX)
    ids = torch.randint(3, 64, (2, CTX), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, own = forward(model, ids, BATCH_INVARIANT_OPS, CTX, rope, routes=True)
    grads, chosen = [], []
    for ops in (BATCH_INVARIANT_OPS, dataclasses.replace(BATCH_INVARIANT_OPS, checkpoint=True)):
        model.zero_grad()
        out, routed = forward(model, ids, ops, CTX, rope, experts=(own + 1) % 4, routes=True)
        out.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        chosen.append(routed)
    assert torch.equal(chosen[0], chosen[1]) and len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))
