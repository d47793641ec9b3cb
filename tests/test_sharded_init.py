"""The random init replayed shard by shard (detrl.models.sharded_init): for the default dense (untied and tied) and
MoE models, each rank's rows of W = 1, 2, 3 equal, bitwise, the rows of `build_model(cfg, seed)` (torch.chunk's
cut, FSDP2's Shard(0)), with at most one full parameter alive; the buffers equal the full build's. The sharded
model under torchrun (DTensor shards, the tie, the buffers) and a 2-rank random-init run's fingerprints are
checked in tests/test_sharded_load.py's launch."""

from __future__ import annotations

import pytest
import torch

from detrl.config import ModelConfig
from detrl.fsdp import shard_rows
from detrl.models.build import build_model
from detrl.models.sharded_init import ShardInitError, meta_random, recording, replay, resolve

MODELS = {"dense": {"name": "qwen3"}, "dense_tied": {"name": "qwen3", "tie_word_embeddings": True}}
MODELS["moe"] = {"name": "qwen3_moe"}


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    lo, hi = shard_rows(t.shape[0], world)[rank]
    return t[lo:hi]


def _replayed(cfg: ModelConfig, seed: int, rank: int, world: int) -> tuple[dict, int]:
    """Rank `rank`'s rows of every parameter, replayed into plain tensors (no process group)."""
    model, plan = meta_random(cfg)
    params = {n: torch.full(_rows(p, rank, world).shape, float("nan")) for n, p in model.named_parameters()}
    return params, replay(plan, params, seed, rank, world)


@pytest.mark.parametrize("name", list(MODELS))
def test_each_ranks_replayed_rows_equal_the_full_builds_bitwise(name):
    cfg = ModelConfig(**MODELS[name])
    want = dict(build_model(cfg, seed=3).named_parameters())
    largest = max(p.numel() for p in want.values())
    for world in (1, 2, 3):
        for rank in range(world):
            got, peak = _replayed(cfg, 3, rank, world)
            assert sorted(got) == sorted(want)  # the tied lm_head once, as named_parameters gives it
            for n, p in want.items():
                assert torch.equal(got[n], _rows(p.detach(), rank, world)), (name, world, rank, n)
            assert peak <= largest  # one full parameter at a time, never the model
    other, _ = _replayed(cfg, 4, 0, 1)  # another seed: other bits (the comparison can fail)
    assert not torch.equal(other["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_the_dead_draws_are_replayed():
    """torch's default init (kaiming_uniform_ of every Linear), overwritten by transformers' normal_, still
    advances the stream: replaying only the live writes gives other bits."""
    cfg = ModelConfig(name="qwen3")
    model, plan = meta_random(cfg)
    dead = [
        i for i, w in enumerate(plan.writes) if w.seeded and i < plan.start.get(plan.names.get(w.root), 0)
    ]
    assert dead
    plan.writes = [w for i, w in enumerate(plan.writes) if i not in set(dead)]
    plan.start = {n: i - sum(d < i for d in dead) for n, i in plan.start.items()}
    plan.end = {n: i - sum(d < i for d in dead) for n, i in plan.end.items()}
    params = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
    replay(plan, params, 3, 0, 1)
    want = dict(build_model(cfg, seed=3).named_parameters())
    assert not torch.equal(
        params["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_the_buffers_equal_the_full_builds(name):
    from detrl.models.sharded_init import Rows
    from detrl.models.sharded_load import fill_buffers

    cfg = ModelConfig(**MODELS[name])
    model, _ = meta_random(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        fill_buffers(model, Rows("", torch.empty(0)))
    want = dict(build_model(cfg, seed=0).named_buffers())
    got = dict(model.named_buffers())
    assert sorted(got) == sorted(want) and len(want) == 2
    assert all(torch.equal(got[n], want[n]) for n in want)


class _Copies(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(4))
        self.b = torch.nn.Parameter(torch.empty(4))
        torch.nn.init.normal_(self.a)
        with torch.no_grad():
            self.b.copy_(self.a)


class _Unset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(4))


class _RandomFactory(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4))


@pytest.mark.parametrize(
    "cls, match",
    [
        (_Copies, r"aten\.copy_.* on b reads another tensor"),
        (_Unset, r"parameter a: never wholly overwritten"),
        (_RandomFactory, r"aten\.randn.*a random op writing no tensor"),
    ],
)
def test_what_cannot_be_replayed_is_one_line(cls, match):
    with pytest.raises(ShardInitError, match=match):
        with recording() as rec:
            model = cls()
        resolve(rec, model)
