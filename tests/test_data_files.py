"""data= tasks from local files: splits, column mapping, one-line errors; model presets and checkpoint-dir checks."""

import json

import pytest

from detrl.config import ConfigError
from detrl.data import DataError, build_task
from detrl.data.tokenizer import build_tokenizer
from tests.conftest import make_cfg
from tests.data_fixtures import GSM8K_ROWS, write_gsm8k, write_math


class _Tok:  # enough of a tokenizer for row-level checks: one id per character
    bos_token_id = None
    chat_template = None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 1000 for c in t] for t in texts]}


def _task(tmp_path, *overrides):
    return build_task(make_cfg("model.init=random", "model.max_position_embeddings=512", *overrides), _Tok())


def test_gsm8k_parquet_and_jsonl_give_the_same_rows_and_a_seeded_split(tmp_path):
    files = write_gsm8k(tmp_path)
    a = _task(
        tmp_path,
        "data=gsm8k",
        f"data.path={files['parquet']}",
        "data.chat_template=false",
        "data.eval_fraction=0.2",
    )
    b = _task(
        tmp_path,
        "data=gsm8k",
        f"data.path={files['jsonl']}",
        "data.chat_template=false",
        "data.eval_fraction=0.2",
    )
    assert len(a) == 16 and len(a.eval_task) == 4
    assert [a[i] for i in range(16)] == [b[i] for i in range(16)]
    golds = {str(x + y) for x, y in [(int(q.split()[2]), int(q.split()[6])) for q, _ in GSM8K_ROWS]}
    assert {a[i].answer for i in range(16)} | {a.eval_task[i].answer for i in range(4)} == golds
    assert a[0].prompt.endswith('Let\'s think step by step and output the final answer after "####".')
    c = _task(
        tmp_path,
        "data=gsm8k",
        f"data.path={files['parquet']}",
        "data.eval_fraction=0.2",
        "seed=1",
        "data.chat_template=false",
    )
    assert {c.eval_task[i].answer for i in range(4)} != {a.eval_task[i].answer for i in range(4)}


def test_math_columns_default_and_map(tmp_path):
    files = write_math(tmp_path / "m")
    dapo = _task(tmp_path, "data=math", f"data.path={files['parquet']}", "data.chat_template=false")
    hendrycks = _task(tmp_path, "data=math", f"data.path={files['jsonl']}", "data.chat_template=false")
    assert sorted(dapo[i].answer for i in range(20)) == sorted(hendrycks[i].answer for i in range(20))
    assert isinstance(dapo[0].prompt, list) and dapo[0].prompt[0]["role"] == "user"
    mapped = _task(
        tmp_path,
        "data=math",
        f"data.path={files['parquet']}",
        "data.answer_key=reward_model.ground_truth",
        "data.prompt_key=prompt",
        "data.chat_template=false",
        "data.shuffle=false",
    )
    assert mapped[0].answer == "\\frac{1}{2}"


@pytest.mark.parametrize(
    "setup,overrides,message",
    [
        (
            None,
            ["data.path=/nonexistent/x.parquet"],
            "data.path='/nonexistent/x.parquet': no such file or directory",
        ),
        ("empty_dir", [], "no .parquet, .jsonl or .json files"),
        ("bad_jsonl", [], "cannot read"),
        ("bad_parquet", [], "cannot read"),
        ("txt", [], "is not .parquet, .jsonl or .json"),
        ("good", ["data.prompt_key=query"], "data.prompt_key='query': no such column"),
        ("good", ["data.answer_key=reward_model.gt"], "data.answer_key='reward_model.gt': no such column"),
        ("mixed", [], "mixes parquet and json files"),
    ],
)
def test_a_missing_or_malformed_file_or_column_is_one_line_naming_it(tmp_path, setup, overrides, message):
    path = tmp_path / "d"
    if setup == "empty_dir":
        path.mkdir()
    elif setup == "bad_jsonl":
        path = tmp_path / "bad.jsonl"
        path.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    elif setup == "bad_parquet":
        path = tmp_path / "bad.parquet"
        path.write_bytes(b"PAR1 this is not parquet")
    elif setup == "txt":
        path = tmp_path / "rows.txt"
        path.write_text("x")
    elif setup == "good":
        path = write_gsm8k(tmp_path / "g")["jsonl"]
    elif setup == "mixed":
        write_gsm8k(path)
    args = ["data=gsm8k", "data.chat_template=false"] + ([f"data.path={path}"] if setup else []) + overrides
    with pytest.raises(DataError) as e:
        _task(tmp_path, *args)
    assert message in str(e.value) and "\n" not in str(e.value)
    if setup in ("bad_jsonl", "bad_parquet"):
        assert path.name in str(e.value)


def test_config_rules_for_file_tasks():
    with pytest.raises(ConfigError, match="data.path"):
        make_cfg("data=gsm8k", "model.init=random")
    with pytest.raises(ConfigError, match="model.init"):
        make_cfg("data=gsm8k", "data.path=/x")  # the warm start is for arithmetic only
    with pytest.raises(ConfigError, match="eval split"):
        make_cfg("data=gsm8k", "data.path=/x", "model.init=random", "eval.every=1")
    with pytest.raises(ConfigError, match="gsm8k_method"):
        make_cfg("data.gsm8k_method=loose")


def test_arithmetic_split_only_with_a_fraction():
    tok = build_tokenizer()
    full = build_task(make_cfg(), tok)
    assert len(full) == 100 and full.eval_task is full
    held = build_task(make_cfg("data.eval_fraction=0.1"), tok)
    assert len(held) == 90 and len(held.eval_task) == 10
    assert {held[i].prompt for i in range(90)}.isdisjoint({held.eval_task[i].prompt for i in range(10)})


# the Qwen3 model cards' counts: 0.6B (0.44B non-embedding), 1.7B (1.4B), 8.2B (6.95B), 30.5B (29.9B)
@pytest.mark.parametrize(
    "preset,arch,params,non_embedding",
    [
        ("qwen3_0p6b", "qwen3", 596_049_920, 0.44e9),
        ("qwen3_1p7b", "qwen3", 1_720_574_976, 1.4e9),
        ("qwen3_8b", "qwen3", 8_190_735_360, 6.95e9),
        ("qwen3_30b_a3b", "qwen3_moe", 30_532_122_624, 29.9e9),
    ],
)
def test_model_presets_have_the_published_shapes(preset, arch, params, non_embedding):
    import torch
    from transformers import AutoModelForCausalLM

    from detrl.models.build import hf_config

    cfg = make_cfg(f"model={preset}")
    assert cfg.model.name == arch and cfg.model.init == "random" and cfg.model.vocab_size == 151936
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
    assert sum(p.numel() for p in model.parameters()) == params
    embeddings = (1 if cfg.model.tie_word_embeddings else 2) * 151936 * cfg.model.hidden_size
    assert abs(params - embeddings - non_embedding) / non_embedding < 0.01


def test_checkpoint_dir_checks_name_what_is_missing(tmp_path):
    from detrl.models.build import checkpoint_architecture

    with pytest.raises(ConfigError, match="no such directory"):
        checkpoint_architecture(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError) as e:
        checkpoint_architecture(tmp_path / "c", need_tokenizer=True)
    assert "missing config.json, model weights" in str(e.value) and "a tokenizer" in str(e.value)
    (tmp_path / "c" / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    (tmp_path / "c" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        checkpoint_architecture(tmp_path / "c", need_tokenizer=True)
    assert str(e.value).endswith("missing a tokenizer (tokenizer.json / tokenizer_config.json)")
    (tmp_path / "c" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="'LlamaForCausalLM'.*is not supported"):
        checkpoint_architecture(tmp_path / "c", need_tokenizer=True)
    (tmp_path / "c" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert checkpoint_architecture(tmp_path / "c", need_tokenizer=True) == "qwen3_moe"
