"""model.path under torchrun built sharded (detrl.models.sharded_load, issue 29): each rank's shards read from the
safetensors equal, bitwise, torch.chunk of what from_pretrained(dtype=float32) loads (dense with a tied embedding
stored in bf16, dense untied, Qwen3-MoE's fused experts from a two-file index), a rank reads only its rows, the
engine is filled by the streaming sync (no full model), the preflight runs on one block, and a 2-rank train.py
run from the checkpoint gives the 1-rank run's fingerprints at every step (dense and MoE); so does a 2-rank run of
the default warm start (no model.path), sharded from its cache directory; and so does a 2-rank model.init=random
run, each rank replaying only its rows of the seed's init (detrl.models.sharded_init), with the full build refused.

One torchrun launch (this file's `worker`, ~45 s on 2 cores with the warm-start run and its SFT); the rest runs in
this process.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.test_distributed import _fps, _one_process, _torchrun

CKPTS = ("dense_tied_bf16", "dense", "moe")
TRAINED = {"dense_tied_bf16": [], "moe": ["model=qwen3_moe"]}  # checkpoint -> its train.py overrides


def write_checkpoints(root: Path) -> dict[str, Path]:
    """Tiny random checkpoints + the arithmetic task's tokenizer: dense with a tied embedding saved in bf16
    (save_pretrained), dense untied (save_pretrained), MoE through detrl's own writer in two files + an index."""
    from detrl.config import ModelConfig
    from detrl.data.tokenizer import build_tokenizer
    from detrl.models.build import build_model
    from detrl.models.hf_save import write_pretrained

    out = {k: root / k for k in CKPTS}
    tied = build_model(ModelConfig(name="qwen3", tie_word_embeddings=True), seed=0).to(torch.bfloat16)
    tied.save_pretrained(out["dense_tied_bf16"])
    build_model(ModelConfig(name="qwen3"), seed=1).save_pretrained(out["dense"])
    moe = build_model(ModelConfig(name="qwen3_moe"), seed=2)
    files = write_pretrained(out["moe"], moe, moe.state_dict().items(), max_shard_bytes=2**20)
    assert len(files) >= 2  # the index path
    for p in out.values():
        build_tokenizer().save_pretrained(p)
    return out


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.mark.parametrize("name", CKPTS)
def test_each_ranks_rows_equal_from_pretrained_chunks_and_are_all_it_reads(ckpts, name):
    from detrl.models.sharded_load import Reader, meta_model, rotary_buffers, shard_of

    ref, meta = _reference(ckpts[name]), meta_model(ckpts[name])
    assert meta.config.to_dict() == ref.config.to_dict() and meta.generation_config == ref.generation_config
    want = dict(ref.named_parameters())
    assert sorted(n for n, _ in meta.named_parameters()) == sorted(want)
    for rank in range(2):
        reader = Reader(ckpts[name])
        for n, p in meta.named_parameters():
            before = reader.read
            got = shard_of(reader, n, p.shape, rank, 2)
            chunk = torch.chunk(want[n].detach(), 2)[rank]
            assert got.dtype == torch.float32 and torch.equal(got, chunk), (name, n, rank)
            assert reader.read - before == chunk.numel(), (name, n, rank)  # its rows, nothing else
        assert reader.read < sum(p.numel() for p in want.values())  # about half of the file
    inv = rotary_buffers(meta.model.rotary_emb)
    assert torch.equal(inv, ref.model.rotary_emb.inv_freq) and torch.equal(
        inv, ref.model.rotary_emb.original_inv_freq
    )
    if name == "dense_tied_bf16":
        assert "lm_head.weight" not in Reader(ckpts[name]).files  # absent from the file: the embedding's
        assert meta.lm_head.weight is meta.model.embed_tokens.weight
        assert Reader(ckpts[name])._slice("model.norm.weight").get_dtype() == "BF16"
    if name == "moe":  # the file holds per-expert tensors; rank 0 reads experts 0 and 1 only
        reader = Reader(ckpts[name])
        assert "model.layers.0.mlp.experts.gate_up_proj" not in reader
        shape = want["model.layers.0.mlp.experts.gate_up_proj"].shape
        shard_of(reader, "model.layers.0.mlp.experts.gate_up_proj", shape, 0, 2)
        assert reader.read == 2 * shape[1] * shape[2] and len(reader._open) == 1


def test_the_meta_model_takes_model_attn_implementation_as_from_pretrained_does(ckpts):
    from transformers import AutoModelForCausalLM

    from detrl.models.sharded_load import meta_model

    path = str(ckpts["dense"])
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    meta = meta_model(path, "eager")
    assert meta.config._attn_implementation == "eager" and meta.config.to_dict() == ref.config.to_dict()


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of a one-file checkpoint with its tensors passed through `edit(dict) -> dict`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_a_missing_or_misshapen_tensor_is_one_line_naming_it_and_its_file(ckpts, tmp_path):
    from detrl.models.sharded_load import Reader, ShardLoadError, meta_model, shard_of, tensor_files

    shape = meta_model(ckpts["dense"]).get_parameter("model.norm.weight").shape
    gone = _rewrite(
        ckpts["dense"], tmp_path / "gone", lambda d: {k: v for k, v in d.items() if k != "model.norm.weight"}
    )
    with pytest.raises(ShardLoadError, match=r"model\.norm\.weight.*gone/model\.safetensors") as e:
        shard_of(Reader(gone), "model.norm.weight", shape, 0, 2)
    assert "\n" not in str(e.value)
    bad = _rewrite(ckpts["dense"], tmp_path / "bad", lambda d: {**d, "model.norm.weight": torch.zeros(7)})
    with pytest.raises(
        ShardLoadError, match=r"model\.norm\.weight.*bad/model\.safetensors.*\[7\].*\[128\]"
    ) as e:
        shard_of(Reader(bad), "model.norm.weight", shape, 1, 2)
    assert "\n" not in str(e.value)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    with pytest.raises(ShardLoadError, match=rf"{expert}.*safetensors.index.json"):
        meta = meta_model(ckpts["moe"])
        reader = Reader(ckpts["moe"])
        reader.files.pop(expert)
        name = "model.layers.1.mlp.experts.gate_up_proj"
        shard_of(reader, name, meta.get_parameter(name).shape, 1, 2)
    with pytest.raises(ShardLoadError, match=r"model\.path=.*nothing.*model\.safetensors"):
        tensor_files(tmp_path / "nothing")


def test_fused_meta_has_fuses_shapes(ckpts):
    from detrl.models.forward import fuse, fused_meta

    model = _reference(ckpts["moe"])
    for dtype in (None, torch.bfloat16):
        got, want = fused_meta(model, dtype).tensors(), fuse(model, dtype).tensors()
        assert [(t.shape, t.dtype, t.device.type) for t in got] == [(t.shape, t.dtype, "meta") for t in want]


# --- under torchrun ---------------------------------------------------------------------------------------------


def _engines_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.weights.tensors(), b.weights.tensors(), strict=True))


def _check_loaded(path: Path) -> dict:
    """This rank's sharded load of `path` vs from_pretrained: shards, buffers, tie; the engines; the preflight."""
    from torch.distributed.tensor import DTensor

    from detrl import distributed
    from detrl.models import BATCH_INVARIANT_OPS
    from detrl.models.forward import fuse, rope_tables
    from detrl.models.preflight import check, first_block, gemm_shapes
    from detrl.models.sharded_load import load_sharded
    from detrl.rollout import EmbeddedEngine, SamplingParams
    from detrl.rollout.cuda_paged import CudaPagedEngine

    rank, world = distributed.rank(), distributed.world_size()
    model, ref = load_sharded(path, torch.device("cpu")), _reference(path)
    want = dict(ref.named_parameters())
    params = list(model.named_parameters())
    buffers = dict(ref.named_buffers())
    params_ok = all(isinstance(p, DTensor) for _, p in params) and all(
        torch.equal(p.to_local(), torch.chunk(want[n].detach(), world)[rank]) for n, p in params
    )
    sampling, ctx = SamplingParams(1.0, 1.0, 8, (2,)), 32
    emb, emb_ref = (EmbeddedEngine(m, BATCH_INVARIANT_OPS, ctx, sampling, seed=0) for m in (model, ref))
    pag, pag_ref = (
        CudaPagedEngine(m, BATCH_INVARIANT_OPS, ctx, sampling, seed=0, device="cpu") for m in (model, ref)
    )
    for e in (emb, pag):
        distributed.sync_weights(model, e)
    one = first_block(model, None)
    shapes = {k: v.shape for k, v in gemm_shapes(one).items()}
    return {
        "params": params_ok,
        "buffers": all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()) and len(buffers) == 2,
        "tied": (model.lm_head.weight is model.model.embed_tokens.weight) == ref.config.tie_word_embeddings,
        "eval": not model.training,
        "engines": _engines_equal(emb, emb_ref) and _engines_equal(pag, pag_ref),
        "preflight_shapes": shapes == {k: v.shape for k, v in gemm_shapes(fuse(ref)).items()},
        "preflight_passes": check(one, BATCH_INVARIANT_OPS, ctx, rope_tables(ref.config, ctx)) == [],
        "first_block": all(
            torch.equal(a, b)
            for a, b in zip(one.layers[0].__dict__.values(), fuse(ref).layers[0].__dict__.values())
            if a is not None
        ),
    }


def warm_start(out: Path, refuse) -> None:
    """The default warm start (no model.path) on a fresh cache: rank 0 builds it once (the SFT), then every rank
    loads its shards of it, policy and reference; its full load (load_or_build) refuses. Records, per rank, the
    SFTs run and the directories `load_sharded` read."""
    import os

    from detrl import builder, distributed
    from detrl.models import sharded_load
    from detrl.trainer import train
    from tests.conftest import make_cfg
    from tests.test_distributed import _train_args

    seen, real_load, real_build = {"sft": 0, "loads": []}, sharded_load.load_sharded, builder.build_and_cache

    def load(path, *args, **kwargs):
        seen["loads"].append(str(path))
        return real_load(path, *args, **kwargs)

    def build(*args, **kwargs):
        seen["sft"] += 1
        return real_build(*args, **kwargs)

    args = _train_args(out / "two-warm", "algo.use_kl_loss=true")
    with (
        mock.patch.dict(
            os.environ, {"DETRL_CACHE_DIR": str(out / "cache")}
        ),  # rank 0's SFT, not the session's
        mock.patch("detrl.builder.load_or_build", refuse),
        mock.patch.object(sharded_load, "load_sharded", load),
        mock.patch.object(builder, "build_and_cache", build),
    ):
        train(make_cfg(*[o for o in args if not o.startswith("run_dir=")]), out / "two-warm")
    (out / f"warm-{distributed.rank()}.json").write_text(json.dumps(seen))


def _check_random() -> dict:
    """This rank's sharded random init (`init_sharded`) vs build_model's: DTensor shards, buffers, tie."""
    from torch.distributed.tensor import DTensor

    from detrl import distributed
    from detrl.config import ModelConfig
    from detrl.models.build import build_model
    from detrl.models.sharded_init import init_sharded

    rank, world, res = distributed.rank(), distributed.world_size(), {}
    cfgs = {
        "dense_tied": ModelConfig(name="qwen3", tie_word_embeddings=True),
        "moe": ModelConfig(name="qwen3_moe"),
    }
    for name, cfg in cfgs.items():
        model, full = init_sharded(cfg, 5, torch.device("cpu")), build_model(cfg, 5)
        want, buffers = dict(full.named_parameters()), dict(full.named_buffers())
        params = list(model.named_parameters())
        res[name] = {
            "params": all(isinstance(p, DTensor) for _, p in params)
            and sorted(n for n, _ in params) == sorted(want)
            and all(torch.equal(p.to_local(), torch.chunk(want[n].detach(), world)[rank]) for n, p in params),
            "buffers": all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
            and len(buffers) == 2,
            "tied": (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings,
        }
    return res


def _worker(out: Path) -> None:
    from detrl import distributed
    from detrl.trainer import train
    from tests.conftest import make_cfg
    from tests.test_distributed import _train_args

    distributed.init()
    res = {name: _check_loaded(out / "ckpts" / name) for name in CKPTS}
    res["random"] = _check_random()
    (out / f"loaded-{distributed.rank()}.json").write_text(json.dumps(res))

    def refuse(*args, **kwargs):
        raise AssertionError("a full model was built under torchrun")

    # the whole model is never built on a rank, policy or reference: the full build (build_model ->
    # from_pretrained) refuses
    def run(name: str, run_dir: Path, *more: str) -> None:
        args = _train_args(run_dir, f"model.path={out / 'ckpts' / name}", *TRAINED[name], *more)
        train(make_cfg(*[o for o in args if not o.startswith("run_dir=")], "algo.use_kl_loss=true"), run_dir)

    with mock.patch("detrl.builder.build_model", refuse):
        warm_start(out, refuse)
        args = _train_args(
            out / "two-random", "model.init=random", "algo.use_kl_loss=true"
        )  # policy + reference
        train(make_cfg(*[o for o in args if not o.startswith("run_dir=")]), out / "two-random")
        run("dense_tied_bf16", out / "two-dense_tied_bf16", "checkpoint.every=1")
        run("moe", out / "two-moe")
        if (
            distributed.is_main()
        ):  # resumed from the dense run's step-1 checkpoint into a model sharded from the file
            shutil.copytree(out / "two-dense_tied_bf16", out / "resumed")
            shutil.rmtree(out / "resumed" / "checkpoints" / "step-000002")
            (out / "resumed" / "summary.json").unlink()
        distributed.barrier()
        run("dense_tied_bf16", out / "resumed", "checkpoint.every=1", "resume=auto")
    distributed.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shardload")
    write_checkpoints(out / "ckpts")
    _torchrun(__file__, "worker", str(out))
    for name, extra in TRAINED.items():
        _one_process(
            out / f"one-{name}", f"model.path={out / 'ckpts' / name}", *extra, "algo.use_kl_loss=true"
        )
    _one_process(out / "one-warm", "algo.use_kl_loss=true")  # the session's cached warm start, loaded in full
    _one_process(out / "one-random", "model.init=random", "algo.use_kl_loss=true")  # build_model, in full
    return out


def test_two_ranks_load_the_warm_start_sharded_and_give_the_one_rank_fingerprints(two_ranks):
    """model.init=warmstart (the default, no model.path) on 2 ranks: rank 0 alone builds the missing cache, then
    both ranks read their shards of it, policy and reference, with every full build refused; the same bits as a
    1-rank run that loads the warm start in full (from_pretrained)."""
    (cached,) = (two_ranks / "cache" / "warmstart").iterdir()
    for r in range(2):
        seen = json.loads((two_ranks / f"warm-{r}.json").read_text())
        assert seen == {"sft": 1 - r, "loads": [str(cached)] * 2}, (r, seen)  # the policy, then the reference
    two, one = _fps(two_ranks / "two-warm"), _fps(two_ranks / "one-warm")
    assert len(two) == 2 and two == one
    assert two[0][1] != two[1][1]  # fp/params moved: it trained
    numerics = json.loads((two_ranks / "two-warm" / "numerics.json").read_text())
    assert numerics["preflight_model"].startswith("1 of 2 layers")  # preflight.first_block: a sharded model


def test_two_ranks_replay_their_rows_of_the_random_init_and_give_the_one_rank_fingerprints(two_ranks):
    """model.init=random on 2 ranks: policy and reference built sharded from the seed, each rank only its rows,
    with the full build (build_model) refused: bitwise the 1-rank run's fingerprints at both steps; and each
    rank's `init_sharded` shards (dense tied, MoE) equal torch.chunk of build_model's, buffers and tie too."""
    for r in range(2):
        res = json.loads((two_ranks / f"loaded-{r}.json").read_text())["random"]
        for name, checks in res.items():
            assert all(checks.values()), (r, name, checks)
    two, one = _fps(two_ranks / "two-random"), _fps(two_ranks / "one-random")
    assert len(two) == 2 and two == one
    assert two[0][1] != two[1][1]  # fp/params moved: it trained
    assert two[0][1] != _fps(two_ranks / "two-warm")[0][1]  # not the warm start's weights
    numerics = json.loads((two_ranks / "two-random" / "numerics.json").read_text())
    assert numerics["preflight_model"].startswith("1 of 2 layers")  # preflight.first_block: a sharded model


def test_the_warm_start_is_one_checkpoint_dir_on_every_path(tmp_path, monkeypatch):
    """builder.checkpoint_dir: model.path, the warm start's cache directory (what load_or_build reads), or none
    (random init); `sharded_build` is every init under W > 1, none at W = 1."""
    from detrl import builder, distributed
    from detrl.data import tokenizer_for
    from detrl.warmstart import warmstart_dir
    from tests.conftest import make_cfg

    warm, rand, path = make_cfg(), make_cfg("model.init=random"), make_cfg(f"model.path={tmp_path}")
    tok = tokenizer_for(warm)
    assert builder.checkpoint_dir(warm, tok) == warmstart_dir(warm.model, warm.data, warm.warmstart, tok)
    assert builder.checkpoint_dir(rand, tok) is None and builder.checkpoint_dir(path, tok) == tmp_path
    assert not any(builder.sharded_build(c) for c in (warm, rand, path))  # one rank: built in full
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert [builder.sharded_build(c) for c in (warm, rand, path)] == [
        True
    ] * 3  # a random init too (sharded_init)


def test_a_two_rank_run_from_a_checkpoint_resumes_exactly(two_ranks):
    from tests.conftest import read_metrics

    assert _fps(two_ranks / "resumed") == _fps(two_ranks / "two-dense_tied_bf16")
    resumed, first = read_metrics(two_ranks / "resumed"), read_metrics(two_ranks / "two-dense_tied_bf16")
    assert resumed[0]["timing_s/step"] == first[0]["timing_s/step"]  # step 1 kept, not run again
    assert resumed[1]["timing_s/step"] != first[1]["timing_s/step"]  # step 2 ran after the restore


def test_two_ranks_load_their_shards_engines_and_preflight_from_the_file(two_ranks):
    for r in range(2):
        res = json.loads((two_ranks / f"loaded-{r}.json").read_text())
        for name in CKPTS:  # (res["random"]: the random init's, checked above)
            assert all(res[name].values()), (r, name, res[name])


@pytest.mark.parametrize("name", list(TRAINED))
def test_two_ranks_from_a_checkpoint_give_the_one_rank_fingerprints(two_ranks, name):
    two, one = _fps(two_ranks / f"two-{name}"), _fps(two_ranks / f"one-{name}")
    assert len(two) == 2 and two == one
    assert two[0][1] != two[1][1]  # fp/params moved: it trained
    numerics = json.loads((two_ranks / f"two-{name}" / "numerics.json").read_text())
    assert numerics["preflight"].startswith("passed") and numerics["preflight_model"].startswith(
        "1 of 2 layers"
    )
    assert "preflight_model" not in json.loads((two_ranks / f"one-{name}" / "numerics.json").read_text())


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
