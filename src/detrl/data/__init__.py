"""Tasks, tokenizers and rewards. Names are imported on first use, so that a reward process (which unpickles
one task) does not pay for `datasets` and `transformers`."""

import importlib

_WHERE = {
    "ArithmeticTask": "arithmetic",
    "exact_match_reward": "arithmetic",
    "DataError": "base",
    "Problem": "base",
    "Task": "base",
    "TASK_NAMES": "registry",
    "build_task": "registry",
    "stop_token_ids": "registry",
    "tokenizer_for": "registry",
    "build_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"detrl.data.{_WHERE[name]}"), name)
