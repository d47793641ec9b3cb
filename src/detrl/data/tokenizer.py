"""A character-level tokenizer the project builds itself (no hub download).

Built with `tokenizers` and wrapped as a transformers `PreTrainedTokenizerFast`, so it saves and
reloads offline with `save_pretrained` / `from_pretrained` like any Hugging Face tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*= ")


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces: "1","8" -> "18"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    return fast


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer from a local dir, or build the project's own when `path` is None."""
    if path is None:
        return build_tokenizer()
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
