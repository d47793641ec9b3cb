"""model.path + data=gsm8k / data=math end to end on CPU: a tiny 151,936-vocab Qwen3 checkpoint with the
Qwen3-compatible tokenizer trains 2 steps on 20-row files, chat template applied, eval/* logged."""

import math
import os
import subprocess
import sys

import pytest

from detrl.builder import build
from detrl.trainer import train
from tests.conftest import ROOT, make_cfg, read_metrics
from tests.data_fixtures import tiny_checkpoint, write_gsm8k, write_math

SMALL = [
    "steps=2",
    "train_batch_size=2",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "micro_batch_size=4",
    "rollout.num_workers=1",
    "logger=none",
    "checkpoint.save_final=false",
    "data.eval_fraction=0.2",
    "eval.every=1",
    "eval.max_prompts=2",
]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "data-fixtures"
    root.mkdir(exist_ok=True)
    return {
        "ckpt": tiny_checkpoint(root),
        "gsm8k": write_gsm8k(root / "gsm8k"),
        "math": write_math(root / "math"),
    }


def test_model_path_brings_its_tokenizer_chat_template_and_stop_ids(files):
    cfg = make_cfg(
        f"model.path={files['ckpt']}", "data=gsm8k", f"data.path={files['gsm8k']['parquet']}", *SMALL
    )
    det, tok, task, rt, model, sampling = build(cfg)
    ctx_len = rt.ctx_len
    assert len(tok) == 151669 and model.config.vocab_size == 151936
    assert sampling.stop_token_ids == (
        151645,
        151643,
    )  # <|im_end|> (tokenizer), + generation_config's <|endoftext|>
    text = tok.decode(task.encode(tok, task[0]))
    assert text.startswith("<|im_start|>user\nTom has ") and text.endswith(
        'output the final answer after "####".<|im_end|>\n<|im_start|>assistant\n'
    )
    assert ctx_len >= max(len(x) for x in task.encode_all(tok)) + 4


def test_gsm8k_parquet_trains_two_steps_and_jsonl_through_the_cli_gives_the_same_bits(files, tmp_path):
    cfg = make_cfg(
        f"model.path={files['ckpt']}", "data=gsm8k", f"data.path={files['gsm8k']['parquet']}", *SMALL
    )
    train(cfg, tmp_path / "parquet")
    a = read_metrics(tmp_path / "parquet")
    assert [m["step"] for m in a] == [1, 2]
    for m in a:
        assert m["reward/errors"] == 0.0 and 0 <= m["eval/accuracy"] <= 1 and m["eval/num_prompts"] == 2
        assert 1 <= m["eval/response_length/mean"] <= 4
    # the same rows as jsonl, through `python train.py` (CPU, a few seconds)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run_dir = tmp_path / "jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"model.path={files['ckpt']}",
            "data=gsm8k",
            f"data.path={files['gsm8k']['jsonl']}",
            *SMALL,
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    b = read_metrics(run_dir)
    assert set(a[0]) == set(b[0])
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k.startswith(("fp/", "eval/accuracy"))} == {
            k: v for k, v in y.items() if k.startswith(("fp/", "eval/accuracy"))
        }


def test_math_dapo_parquet_and_hendrycks_jsonl_train_with_thinking_off(files, tmp_path):
    for name, path in files["math"].items():
        cfg = make_cfg(
            f"model.path={files['ckpt']}",
            "data=math",
            f"data.path={path}",
            "data.enable_thinking=false",
            *SMALL,
            "eval.every=2",
        )
        det, tok, task, *_ = build(cfg)
        text = tok.decode(task.encode(tok, task[0]))
        assert text.startswith("<|im_start|>user\nWhat is $") and text.endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        train(cfg, tmp_path / name)
        m = read_metrics(tmp_path / name)
        assert (
            [x["step"] for x in m] == [1, 2]
            and math.isnan(m[0]["eval/accuracy"])
            and m[1]["eval/num_prompts"] == 2
        )
        assert all(x["reward/errors"] == 0.0 for x in m)


def test_a_checkpoint_of_the_wrong_kind_is_refused_in_one_line(files):
    from detrl.config import ConfigError

    cfg = make_cfg(
        f"model.path={files['ckpt']}",
        "model=qwen3_moe",
        "data=gsm8k",
        f"data.path={files['gsm8k']['parquet']}",
        *SMALL,
    )
    with pytest.raises(ConfigError, match="holds a qwen3 checkpoint; use model=qwen3"):
        build(cfg)
