import torch
import torch.nn.functional as F

from detrl.probe import MODES, format_table, probe
from tests.conftest import make_cfg

SMALL = ["model.init=random"]


def test_probe_finds_one_output_per_mode_with_determinism_on():
    counts = probe(make_cfg("determinism=on", *SMALL), trials=12, targets=2, max_bs=14)
    assert counts == {m: (1, 1) for m in MODES}


def test_probe_sees_the_shared_stream_and_the_kernels_with_determinism_off():
    cfg = make_cfg("determinism=off", *SMALL)
    stream = probe(cfg, trials=12, targets=2, max_bs=14)
    assert all(stream[m][0] > 1 for m in MODES)  # a random tiny model is broad: new draws, new tokens
    seeded = probe(cfg, trials=12, targets=2, max_bs=14, seeded=True)
    # the kernels alone: as many patterns as this CPU's gemm gives a row alone vs among >= 12 rows
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 128, generator=g), torch.randn(128, 128, generator=g)
    gemm_varies = not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])
    assert (seeded["single"][1] > 1) == gemm_varies
    assert "single" in format_table({"x": stream}, 12)
