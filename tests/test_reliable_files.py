"""Files trusted too much: a crafted pickle does not run, corrupt checkpoints fall back or are refused in one
line, a garbage metrics line drops no valid row, leftover temp dirs go at the next start."""

import json
import os
import pathlib

import numpy as np
import pytest
import torch

from detrl import checkpoint
from detrl.config import ConfigError
from tests.conftest import TINY, make_cfg, read_metrics, run_tiny


class _Payload:  # what an attacker pickles: unpickling it would create the marker file
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _train(tmp_path, *overrides):
    from detrl.trainer import train

    train(make_cfg(*TINY, *overrides), tmp_path)
    return read_metrics(tmp_path)


def test_a_crafted_pickle_in_state_pt_does_not_run(tmp_path):
    from detrl import forensics

    run_tiny(tmp_path)
    ckpt = checkpoint.latest(tmp_path)
    marker = tmp_path / "pwned"
    payload = torch.load(ckpt / "state.pt", weights_only=True)
    payload["run"]["wandb_id"] = _Payload(marker)
    torch.save(payload, ckpt / "state.pt")
    checkpoint.write_manifest(ckpt)  # a consistent manifest: the load itself must refuse
    with pytest.raises(ConfigError, match=r"resume refused: .*state.pt holds more than tensors") as e:
        _train(tmp_path, "resume=auto", "steps=4")
    assert "\n" not in str(e.value) and not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 - the forensics loader refuses too (torch's own error)
        forensics.load_policy(tmp_path, 3)
    assert not marker.exists()


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip64":  # 64 flipped bytes in the middle (the tensors' storage)
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    else:
        data = data[: len(data) // 3]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip64", "truncate"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, how, capfd):
    straight = run_tiny(tmp_path / "straight", "steps=4")
    run = tmp_path / "run"
    run_tiny(run, "checkpoint.every=1")
    assert checkpoint.latest(run).name == "step-000003"
    _corrupt(checkpoint.latest(run) / "state.pt", how)
    rows = _train(run, "resume=auto", "steps=4")
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "not intact" in line]
    assert len(lines) == 1 and "step-000003" in lines[0] and "resuming from step-000002" in lines[0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["fp/params"] for r in rows] == [r["fp/params"] for r in straight]  # bitwise the same run


def test_no_intact_checkpoint_is_refused_in_one_line_and_loses_nothing(tmp_path):
    run_tiny(tmp_path, "checkpoint.every=1")
    before = (tmp_path / "metrics.jsonl").read_text()
    for ckpt in checkpoint.checkpoint_root(tmp_path).glob("step-*"):
        _corrupt(ckpt / "state.pt", "flip64")
    with pytest.raises(
        ConfigError, match=r"no intact checkpoint .*step-000003: state.pt does not match"
    ) as e:
        _train(tmp_path, "resume=auto", "steps=4")
    assert "\n" not in str(e.value) and (tmp_path / "metrics.jsonl").read_text() == before
    with pytest.raises(ConfigError, match="refused: state.pt does not match"):  # named explicitly: refused
        checkpoint.resolve(str(checkpoint.latest(tmp_path)), tmp_path)


def test_a_garbage_line_in_metrics_drops_no_valid_row(tmp_path, capfd):
    rows = run_tiny(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    garbled = [lines[0], '{"step": 2, "fp/par\x00\x00 garbage', *lines[1:], '{"step": 4, "torn']
    (tmp_path / "metrics.jsonl").write_text("\n".join(garbled) + "\n")
    resumed = _train(tmp_path, "resume=auto", "steps=4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:3] == rows  # every valid row kept, as it was
    err = [line for line in capfd.readouterr().err.splitlines() if "not JSON rows" in line]
    assert len(err) == 1 and "[2, 5]" in err[0]
    assert (tmp_path / "metrics.jsonl.corrupt").read_text() == "\n".join(garbled) + "\n"


def test_leftover_temp_dirs_are_removed_at_the_next_start(tmp_path):
    run_tiny(tmp_path)
    root = checkpoint.checkpoint_root(tmp_path)
    (root / ".tmp-killed").mkdir()
    (root / ".tmp-killed" / "state.pt").write_bytes(os.urandom(4096))
    (root / ".tmp-step-000004").mkdir()
    (tmp_path / "metrics.jsonl.tmp").write_text("partial")
    _train(tmp_path, "resume=auto", "steps=4")
    assert not list(root.glob(".tmp-*")) and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert checkpoint.verify(checkpoint.latest(tmp_path)) is None


def test_rng_states_and_the_partial_buffer_round_trip_through_weights_only(tmp_path):
    from detrl.rollout.base import Request
    from detrl.rollout.partial import Group, PartialBuffer, Sample

    req = Request(7, 1, (1, 2, 3), seed=11, prefix=(4,), max_new_tokens=2)
    experts = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    sample = Sample(req, [4, 5], [-0.5, -1.25], [0, 1], None, experts)
    buffer = PartialBuffer([Group(7, "12", [sample, Sample(req)])])
    gen = torch.Generator().manual_seed(3)
    torch.save({"run": checkpoint._run_plain(checkpoint.RunState(2, 5, [0.5], "abc", buffer)),
                "rng": checkpoint._rng(gen)}, tmp_path / "x.pt")  # fmt: skip
    back = checkpoint.safe_load(tmp_path / "x.pt")
    state = checkpoint._run_state(back["run"])
    got = state.buffer.groups[0]
    assert (got.prompt_uid, got.answer, got.samples[0].request) == (7, "12", req)
    assert got.samples[0].tokens == [4, 5] and got.samples[0].logprobs == [-0.5, -1.25]
    assert np.array_equal(got.samples[0].routed_experts, experts) and got.samples[1].routed_experts is None
    expect = (np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    checkpoint._set_rng(back["rng"], gen)
    assert (np.random.rand(), torch.rand(1), torch.rand(1, generator=gen)) == expect
    assert json.dumps(state.curve) == "[0.5]"
