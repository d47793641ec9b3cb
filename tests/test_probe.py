"""The probe's rows each let one cause vary; what each must show follows from its design, on any hardware."""

import pytest

from detrl.probe import MODES, ROWS, Row, format_table, probe
from tests.conftest import make_cfg

SMALL = ["model.init=random"]  # a random tiny model samples broadly: new noise, new tokens


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def counts(request):
    return probe(make_cfg(f"model={request.param}", *SMALL), trials=12, targets=2, max_bs=14)


def test_nothing_varying_gives_one_output(counts):
    assert counts["control"] == {m: (1, 1) for m in MODES}


def test_an_advancing_stream_alone_gives_new_outputs(counts):
    # the batch is the same every trial: only the stream's position moves
    assert all(counts["stream advance"][m][0] > 1 for m in MODES)


def test_batch_mates_move_the_targets_draws_on_a_shared_stream(counts):
    # reseeded alike each trial, batch-invariant kernels: only the target's slot among the draws changes
    assert all(counts["batch composition"][m][0] > 1 for m in MODES)


def test_per_sample_seeds_and_batch_invariant_ops_give_one_output_under_any_batch_mates(counts):
    assert counts["determinism=on"] == {m: (1, 1) for m in MODES}


def test_a_target_always_alone_has_no_composition_effect():
    # the old "shared sampling stream" rows gave 12 distinct outputs of 12 here: they measured stream advance
    cfg = make_cfg(*SMALL)
    rows = {k: ROWS[k] for k in ("batch composition", "kernels", "stream advance")}
    alone = probe(cfg, trials=12, targets=2, max_bs=1, rows=rows)
    assert alone["batch composition"] == {m: (1, 1) for m in MODES}
    assert alone["kernels"] == {m: (1, 1) for m in MODES}  # one row alone: always the same kernel call
    assert all(alone["stream advance"][m][0] > 1 for m in MODES)


def test_the_table_names_every_row_and_mode(counts):
    table = format_table(counts, 12)
    assert all(name in table for name in ROWS) and all(m in table for m in MODES)
    assert isinstance(ROWS["control"], Row)
