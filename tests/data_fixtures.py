"""Small files the data tests make: a tiny 151,936-vocab Qwen3 checkpoint with the Qwen3-compatible tokenizer,
and 20-row GSM8K / math datasets as parquet and jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

GSM8K_ROWS = [
    (
        f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        f"He has {a}+{b}={a + b} apples.\n#### {a + b}",
    )
    for a, b in [
        (3, 4),
        (10, 5),
        (7, 8),
        (12, 30),
        (1, 1),
        (6, 9),
        (20, 22),
        (15, 15),
        (2, 40),
        (9, 9),
        (11, 4),
        (13, 7),
        (5, 5),
        (8, 16),
        (30, 3),
        (4, 44),
        (17, 2),
        (25, 25),
        (14, 1),
        (1000, 234),
    ]
]
MATH_ROWS = [
    (f"What is ${a}/{b}$ in lowest terms?", f"\\frac{{{a}}}{{{b}}}" if b != 1 else str(a))
    for a, b in [
        (1, 2),
        (2, 3),
        (3, 4),
        (5, 6),
        (7, 8),
        (1, 3),
        (4, 5),
        (5, 7),
        (2, 9),
        (7, 10),
        (3, 1),
        (9, 1),
        (1, 5),
        (6, 7),
        (8, 9),
        (3, 5),
        (1, 7),
        (4, 9),
        (2, 5),
        (3, 8),
    ]
]


def tiny_checkpoint(root: Path) -> Path:
    """A random 1-layer Qwen3 (vocab 151,936, hidden 32) saved with save_pretrained + the Qwen3-compatible tokenizer
    + Qwen3's generation_config eos ids, cached in `root`."""
    out = root / "tiny-qwen3-151936"
    if (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from detrl.data.qwen_tokenizer import build_qwen3_tokenizer

    tok = build_qwen3_tokenizer()
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    tmp = root / ".tmp-tiny"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(
        tmp
    )
    tmp.rename(out)
    return out


def write_gsm8k(root: Path) -> dict[str, Path]:
    rows = [{"question": q, "answer": a} for q, a in GSM8K_ROWS]
    root.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(root / "gsm8k.parquet")
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"parquet": root / "gsm8k.parquet", "jsonl": root / "gsm8k.jsonl"}


def write_math(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    # DAPO-Math-17k layout (verl): prompt = chat messages, reward_model = {ground_truth, style}
    dapo = [
        {
            "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": a, "style": "rule"},
            "data_source": "math",
        }
        for q, a in MATH_ROWS
    ]
    pd.DataFrame(dapo).to_parquet(root / "dapo.parquet")
    # MATH layout: problem / solution with the answer in \boxed{}
    hendrycks = [
        {"problem": q, "solution": f"Reduce it: the answer is $\\boxed{{{a}}}$."} for q, a in MATH_ROWS
    ]
    (root / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hendrycks))
    return {"parquet": root / "dapo.parquet", "jsonl": root / "math.jsonl"}
