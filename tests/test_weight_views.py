"""The engine's in-place weight sync: each state-dict entry into its part of the fused weights."""

import pytest
import torch

from detrl.config import ModelConfig
from detrl.models.build import build_model
from detrl.models.forward import fuse
from detrl.rollout.weight_views import copy_into, views


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pairs_one_at_a_time_give_the_fused_weights_of_the_new_model(name, dtype):
    old, new = (build_model(ModelConfig(name=name), seed=s) for s in (0, 1))
    with torch.no_grad():
        engine = fuse(old, dtype).map(lambda t: t.detach().clone())
        want = fuse(new, dtype)
    sd = new.state_dict()
    assert sorted(views(engine)) == sorted(sd)  # every name has its place, and only those
    copy_into(engine, reversed(sorted(sd.items())))  # any order
    for got, w in zip(engine.tensors(), want.tensors(), strict=True):
        assert got.dtype == w.dtype and torch.equal(got, w)


def test_an_unknown_or_missing_name_is_named():
    model = build_model(ModelConfig(name="qwen3"), seed=0)
    with torch.no_grad():
        engine = fuse(model).map(lambda t: t.detach().clone())
    sd = model.state_dict()
    with pytest.raises(KeyError, match="model.layers.9.mlp"):
        copy_into(engine, [("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="did not send 'lm_head.weight'"):
        copy_into(engine, [(k, v) for k, v in sd.items() if k != "lm_head.weight"])
