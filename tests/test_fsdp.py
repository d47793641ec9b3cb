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


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
