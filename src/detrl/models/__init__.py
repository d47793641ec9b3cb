from detrl.models.build import build_model
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
