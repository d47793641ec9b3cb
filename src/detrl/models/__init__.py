"""The functional forward, its op sets, and the model builder. `build_model` is imported on first use: it loads
transformers' model code (~5 s), which validating a config or scoring logprobs does not need."""

from detrl.models.forward import KVCache, forward, token_logprobs
from detrl.models.ops import BATCH_INVARIANT_OPS, DEFAULT_OPS, Ops

__all__ = [
    "BATCH_INVARIANT_OPS",
    "DEFAULT_OPS",
    "KVCache",
    "Ops",
    "build_model",
    "forward",
    "token_logprobs",
]


def __getattr__(name: str):
    if name == "build_model":
        from detrl.models.build import build_model

        return build_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
