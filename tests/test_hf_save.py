"""The streaming Hugging Face writer against transformers' own reader and writer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from detrl.models.hf_save import write_pretrained

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)  # fmt: skip


def _model(kind: str, tied: bool):
    torch.manual_seed(0)
    if kind == "dense":
        return Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=tied))
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied
        )
    )


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.mark.parametrize("kind,tied", [("dense", True), ("dense", False), ("moe", True)])
@pytest.mark.parametrize("shard_bytes", [10**9, 20_000])
def test_transformers_loads_it_and_writes_the_same_tensors(tmp_path, kind, tied, shard_bytes):
    m = _model(kind, tied)
    sd = m.state_dict()
    files = write_pretrained(tmp_path / "ours", m, sorted(sd.items()), max_shard_bytes=shard_bytes)
    assert (len(files) > 1) == (shard_bytes < 10**9)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file() == (len(files) > 1)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), local_files_only=True, dtype=torch.float32
    )
    got = loaded.state_dict()
    assert sorted(got) == sorted(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    m.save_pretrained(tmp_path / "theirs")  # transformers' own writer: the same names and bits
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def _worker(out: Path) -> None:
    """2 ranks: each model sharded per block, saved by `save_model` (streamed to rank 0); rank 0 checks the files
    with transformers' loader against the unsharded model."""
    from detrl import distributed
    from detrl.config import ModelConfig
    from detrl.models.build import build_model
    from detrl.models.hf_save import save_model

    distributed.init()
    res = {}
    for name in ("qwen3", "qwen3_moe"):
        want = build_model(ModelConfig(name=name), seed=0).state_dict()
        model = build_model(ModelConfig(name=name), seed=0)
        distributed.shard(model)
        save_model(out / name, model)
        distributed.barrier()
        if distributed.is_main():
            got = AutoModelForCausalLM.from_pretrained(
                str(out / name), local_files_only=True, dtype=torch.float32
            )
            sd = got.state_dict()
            res[name] = sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k]) for k in want)
    if distributed.is_main():
        (out / "result.json").write_text(json.dumps(res))
    distributed.close()


def test_a_sharded_model_is_saved_one_parameter_at_a_time(tmp_path):
    from tests.test_distributed import _torchrun

    _torchrun(__file__, "worker", str(tmp_path))
    assert json.loads((tmp_path / "result.json").read_text()) == {"qwen3": True, "qwen3_moe": True}


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
