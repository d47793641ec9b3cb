"""Values that must not be accepted: each fails in one line naming the value; a NaN / inf gradient norm skips
the optimizer step; a full disk stops the run in one line with the previous checkpoint intact."""

import json
import math
import subprocess
import sys

import pytest
import torch

from detrl import checkpoint, guards
from detrl.config import ConfigError
from detrl.data import DataError, build_task
from tests.conftest import ROOT, TINY, make_cfg, read_metrics, run_tiny

REFUSED = [  # (override(s), what the one line must name)
    (["lr=inf"], "lr=inf"),
    (["lr=nan"], "lr=nan"),
    (["rollout.n=1"], "rollout.n=1"),
    (["optim.lr_warmup_steps=60"], "optim.lr_warmup_steps=60"),
    (["optim.lr_warmup_steps_ratio=1.0"], "optim.lr_warmup_steps_ratio=1.0"),
    (["steps=0"], "steps=0"),
    (["rollout.temperature=inf"], "rollout.temperature=inf"),
    (["algo.kl_loss_coef=-0.1"], "algo.kl_loss_coef=-0.1"),
    (["warmstart.steps=-1"], "warmstart.steps=-1"),
    (["optim.num_cycles=-1"], "optim.num_cycles=-1"),
    (["rollout.sglang.retries=-1"], "rollout.sglang.retries=-1"),
    (["model.vocab_size=0"], "model.vocab_size=0"),
    (["model.num_hidden_layers=0"], "model.num_hidden_layers=0"),
    (["model.head_dim=0"], "model.head_dim=0"),
    (["model.num_key_value_heads=0"], "model.num_key_value_heads=0"),
    (["optim.max_nonfinite_grad_steps=0"], "optim.max_nonfinite_grad_steps=0"),
]


@pytest.mark.parametrize("overrides, needle", REFUSED, ids=[r[1] for r in REFUSED])
def test_values_no_run_accepts_fail_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        make_cfg(*overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["model.vocab_size=0", "steps=0", "rollout.temperature=inf"])
def test_the_cli_says_one_line_not_a_traceback(tmp_path, override):
    proc = subprocess.run(
        [sys.executable, "train.py", override, f"hydra.run.dir={tmp_path / 'run'}", "logger=none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        line for line in proc.stderr.splitlines() if override in line
    ]


def test_positions_below_the_context_are_refused_in_one_line():
    from detrl.data.tokenizer import build_tokenizer

    with pytest.raises(
        ConfigError, match=r"model.max_position_embeddings=8 is too small: .* data.max_prompt_length<=4"
    ):
        build_task(make_cfg("model.max_position_embeddings=8"), build_tokenizer())
    build_task(make_cfg("model.max_position_embeddings=16"), build_tokenizer())  # 6 + 4 tokens fit


class _Tok:  # one id per character
    bos_token_id = None
    chat_template = None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 1000 for c in t] for t in texts]}


def _gsm8k(tmp_path, rows, *overrides):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode() for r in rows))
    cfg = make_cfg("data=gsm8k", f"data.path={path}", "model.init=random", "data.prompt_template='{prompt}'", "data.chat_template=false",
                   "model.max_position_embeddings=512", *overrides)  # fmt: skip
    return build_task(cfg, _Tok())


GOOD = {"question": "1+1?", "answer": "so #### 2"}
BAD_ROWS = [
    ([GOOD, {"question": "q", "answer": None}], r"row 1 has no answer in column 'answer' \('None'"),
    ([GOOD, GOOD, {"question": "q"}], r"row 2 has no answer"),
    ([{"question": "q", "answer": "#### lots"}, GOOD], r"row 0 has no number after '####'"),
    ([GOOD, b'{"question": "caf\xe9 \xff", "answer": "#### 3"}\n'], r"row 1 of .* is not UTF-8 text"),
]


@pytest.mark.parametrize("rows, message", BAD_ROWS, ids=["null", "missing", "not-a-number", "non-utf8"])
def test_bad_gsm8k_rows_refuse_the_file_in_one_line_naming_the_row(tmp_path, rows, message):
    with pytest.raises(DataError, match=message) as e:
        _gsm8k(tmp_path, rows)
    assert "\n" not in str(e.value)


def test_a_prompt_longer_than_the_positions_is_refused_in_one_line(tmp_path):
    rows = [GOOD, {"question": "x" * 600, "answer": "#### 1"}]
    with pytest.raises(ConfigError, match=r"=512 is too small: .* \('xxxx.* has 600 prompt tokens"):
        _gsm8k(tmp_path, rows)
    assert len(_gsm8k(tmp_path, rows, "data.max_prompt_length=508")) == 1  # the fix it names works


def test_finite_step_skips_counts_and_stops_after_n_in_a_row():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    guards.finite_step(opt, 1.0, 2)
    before = p.detach().clone()
    p.grad = torch.full((3,), math.nan)
    guards.finite_step(opt, math.nan, 2)
    assert (
        torch.equal(p.detach(), before) and guards.pop_nonfinite(opt) == 1 and guards.pop_nonfinite(opt) == 0
    )
    p.grad = torch.ones(3)
    guards.finite_step(opt, 1.0, 2)  # a finite norm resets the run of non-finite ones
    guards.finite_step(opt, math.inf, 2)
    with pytest.raises(guards.NonFiniteGradients, match=r"was nan for 2 optimizer steps in a row") as e:
        guards.finite_step(opt, math.nan, 2)
    assert "\n" not in str(e.value)


def test_a_nan_gradient_takes_no_optimizer_step_in_training(tmp_path, monkeypatch):
    from detrl.actor import step

    agg = step.agg_loss
    monkeypatch.setattr(step, "agg_loss", lambda *a, **k: agg(*a, **k) * math.nan)
    with pytest.raises(guards.NonFiniteGradients, match="max_nonfinite_grad_steps=3"):
        run_tiny(tmp_path, "steps=4", "optim.max_nonfinite_grad_steps=3")
    rows = read_metrics(tmp_path)
    assert [r["actor/nonfinite_grad_steps"] for r in rows] == [1.0, 1.0]
    assert rows[0]["fp/params"] == rows[1]["fp/params"]  # no step taken: the weights did not move
    assert all(math.isnan(r["actor/grad_norm"]) for r in rows)


def test_a_full_disk_stops_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from detrl.trainer import train

    run_tiny(tmp_path, "checkpoint.every=1")
    real = torch.save

    def full(obj, f, *a, **k):
        real(obj, f, *a, **k)
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 5632 vs 5520")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(
        ConfigError, match=r"checkpoint of step 4 not written \(disk full\?\): .*unexpected pos"
    ) as e:
        train(make_cfg(*TINY, "resume=auto", "steps=4", "checkpoint.every=1"), tmp_path)
    assert "\n" not in str(e.value)
    root = checkpoint.checkpoint_root(tmp_path)
    assert not list(root.glob(".tmp-*")) and checkpoint.latest_intact(tmp_path).name == "step-000003"
