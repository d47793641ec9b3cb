"""detrl.fsdp: FSDP2 per decoder block then the root; gathers in fp32 on CPU and under `on`; the weight sync and
`fp/params` one parameter at a time, with the digest of the whole state dict (torchrun, gloo, 2 ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from detrl.fingerprint import StreamDigest, param_sketch, params_digest
from detrl.fsdp import param_dtype
from tests.test_distributed import _torchrun


def test_gathers_stay_fp32_on_cpu_and_under_on():
    f32, bf16 = torch.float32, torch.bfloat16
    assert param_dtype("cuda", bf16, ordered=False, master=f32) == bf16  # torchtitan's bf16 params
    assert param_dtype("cuda", bf16, ordered=True, master=f32) == f32  # on: the bits of one process
    assert param_dtype("cpu", bf16, ordered=False, master=f32) == f32


def test_stream_digest_is_the_state_dicts():
    from detrl.config import ModelConfig
    from detrl.models.build import build_model

    model = build_model(ModelConfig(name="qwen3"), seed=0)
    sd = model.state_dict()
    h = StreamDigest()
    seen = [n for n, _ in h.pass_through((n, sd[n]) for n in sorted(sd))]
    assert seen == sorted(sd)
    assert h.hexdigest() == params_digest(model)
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] += 1.0
    assert h.hexdigest() != params_digest(model)


class _Engine:
    """Records what a weight sync hands it: pairs, one at a time."""

    def __init__(self):
        self.got: dict[str, torch.Tensor] = {}

    def update_weights(self, items):
        for name, t in items:
            self.got[name] = t.clone()


def _worker(out: Path) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from detrl import distributed, fsdp
    from detrl.config import ModelConfig
    from detrl.models.build import build_model

    distributed.init()
    want = build_model(ModelConfig(name="qwen3"), seed=0)
    model = build_model(ModelConfig(name="qwen3"), seed=0)
    distributed.shard(model)
    blocks = fsdp.blocks(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    engine = _Engine()
    fp = distributed.sync_weights(model, engine)
    ref = want.state_dict()
    distributed.unshard(model)
    gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = not any(isinstance(p, DTensor) for p in model.parameters())
    distributed.reshard(model)
    drift_same = True  # the drift sketch over parameters gathered one at a time: one process's numbers
    params = fsdp.full_params(model)
    if distributed.is_main():
        got, want_sk = param_sketch(model, tensors=params), param_sketch(want)
        drift_same = bool((got[0] == want_sk[0]).all()) and got[1] == want_sk[1]
    for _ in params:
        pass
    res = {
        "drift_same": drift_same,
        "blocks_sharded": len(blocks) > 0 and all(isinstance(b, FSDPModule) for b in blocks),
        "groups": len(fsdp.groups(model)),
        "n_blocks": len(blocks),
        "local_frac": local / sum(p.numel() for p in want.parameters()),
        "digest_same": fp == params_digest(want),
        "engine_same": sorted(engine.got) == sorted(ref)
        and all(torch.equal(engine.got[n], ref[n]) for n in ref),
        "unshard_same": plain and all(torch.equal(gathered[n], p) for n, p in want.named_parameters()),
        "resharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }
    (out / f"fsdp-{distributed.rank()}.json").write_text(json.dumps(res))
    distributed.close()


def test_two_ranks_shard_per_block_and_sync_one_parameter_at_a_time(tmp_path):
    _torchrun(__file__, "worker", str(tmp_path))
    for r in range(2):
        res = json.loads((tmp_path / f"fsdp-{r}.json").read_text())
        assert res["blocks_sharded"] and res["groups"] == res["n_blocks"] + 1, res
        assert 0.3 < res["local_frac"] < 0.7, res  # this rank holds about half of the parameters
        assert res["digest_same"] and res["engine_same"], res  # the same bits as one process's state dict
        assert res["unshard_same"] and res["resharded"] and res["drift_same"], res


# micro_batch_size=3 over test_update's 8 sequences: micro-batches of 3, 3, 2; on 2 ranks rank 1 holds none in
# the last round. `current`: the gradient pass's logprobs are the old ones
# bf16: the compute dtype of GPU runs (fp32 masters): the gathers carry the matrices in it
UPDATE_CASES = [
    ("qwen3", "recompute", "float32"),
    ("qwen3", "current", "float32"),
    ("qwen3_moe", "recompute", "float32"),
    ("qwen3", "recompute", "bfloat16"),
    ("qwen3_moe", "current", "bfloat16"),
]


def _gathered_bytes(params, dtype: str) -> int:
    """What `fsdp.gather_cast` gathers of these parameters: matrices in the compute dtype, vectors in fp32."""
    return sum(p.numel() * (2 if dtype == "bfloat16" and p.dim() >= 2 else 4) for p in params)


def _update(model_name: str, old: str, dtype: str, sharded: bool):
    """update() on test_update's batch in the compute dtype -> (the whole gradient, the model, its metrics)."""
    import dataclasses

    from detrl import distributed
    from detrl.config import ModelConfig
    from detrl.models import build_model
    from detrl.models.forward import rope_tables
    from tests.actor_helpers import update
    from tests.test_update import OPS, L, _batch, _cfg, _Recorder

    class Full(_Recorder):
        def step(self):
            self.grads.append([getattr(p.grad, "full_tensor", p.grad.clone)() for p in self.params])

    model = build_model(ModelConfig(name=model_name), seed=0)
    ref = build_model(ModelConfig(name=model_name), seed=1).requires_grad_(False)
    dp = None
    if sharded:
        distributed.shard(model, ref)
        dp = distributed.DataParallel(model, ordered=True)
    cfg = _cfg("micro_batch_size=3", f"algo.old_logprobs={old}", "algo.kl_loss_coef=0.1")
    batch, adv = _batch()
    opt = Full(model.parameters())
    ops = dataclasses.replace(OPS["on"], dtype=getattr(torch, dtype))
    rope = rope_tables(model.config, L, "cpu", ops.dtype)
    m = update(model, ref, opt, batch, adv, cfg, ops, L, rope, version=0, dp=dp)
    return opt.grads[0], model, m


def _update_worker(out: Path) -> None:
    """Under torchrun: each case's gradient and metrics, and the most elements the gathers held at once."""
    from detrl import distributed, fsdp

    distributed.init()
    torch.use_deterministic_algorithms(True)
    res = {}
    for case in UPDATE_CASES:
        grads, model, m = _update(*case, sharded=True)
        blocks = [sum(p.numel() for p in b.parameters()) for b in fsdp.blocks(model)]
        root = sum(p.numel() for p in fsdp.root_params(model))
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        book = fsdp.gathers(model)
        res[case] = dict(
            grads=grads, metrics=m, peak=book.peak, root=root, block=max(blocks), peak_bytes=book.peak_bytes,
            block_bytes=max(_gathered_bytes(b.parameters(), case[2]) for b in fsdp.blocks(model)),
            root_bytes=_gathered_bytes(fsdp.root_params(model), "float32" if tied else case[2]),
        )  # fmt: skip
    if distributed.is_main():
        torch.save(res, out / "update.pt")
    distributed.close()


def test_two_ranks_gather_one_block_at_a_time_and_give_one_processs_bits(tmp_path):
    """2 ranks, 3 micro-batches (rank 1 holds none in the last round; dense, MoE, `current`, fp32 and bf16
    compute): the gradient and every metric are one process's bits, and the forward, its checkpointed recompute
    and the backward never hold more than the root group and one block's full parameters at once (in bf16, the
    blocks' matrices gathered in bf16: about half the bytes)."""
    _torchrun(__file__, "update", str(tmp_path))
    got = torch.load(tmp_path / "update.pt")
    torch.use_deterministic_algorithms(True)
    try:
        for case in UPDATE_CASES:
            r = got[case]
            assert r["block"] <= r["peak"] <= r["root"] + r["block"], (case, r["peak"], r["root"], r["block"])
            assert r["block_bytes"] <= r["peak_bytes"] <= r["root_bytes"] + r["block_bytes"], (case, r)
            if case[2] == "bfloat16":  # a block's gather: its matrices in bf16, about half an fp32 gather
                assert r["block_bytes"] < 0.55 * 4 * r["block"], (case, r["block_bytes"], r["block"])
            grads, _, m = _update(*case, sharded=False)
            assert any(g.abs().sum() > 0 for g in grads)
            assert len(grads) == len(r["grads"]) and all(map(torch.equal, r["grads"], grads)), case
            assert r["metrics"] == m, case
    finally:
        torch.use_deterministic_algorithms(False)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:2] == ["update"]:
    _update_worker(Path(sys.argv[2]))


_TRIM_PROBE = """
import torch
from detrl.device import trim_host_memory
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
big = torch.ones(4 << 20)  # a 16 MiB block freed: glibc's mmap threshold rises, later blocks come from the heap
del big
held, keep = [], []
for _ in range(64):  # 64 x 4 MiB on the heap, each followed by a small live block: holes, not a free top
    held.append(torch.ones(1 << 20))
    keep.append(torch.ones(50_000))  # 200 KB: carved from the heap top, between the big ones
del held
before = rss(); trim_host_memory(); after = rss()
print(before, after)
"""


def test_trim_host_memory_returns_the_heaps_free_pages():
    """What a sharded rank's gathers rely on: freed heap blocks stay resident until trimmed (glibc)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after > 128, (before, after)  # MiB: most of the 256 MiB freed comes back
