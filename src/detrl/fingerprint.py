"""Short hex digests of exact bytes: two runs are identical up to step t iff these match up to t."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

DIGEST_CHARS = 16


def digest(chunks: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def ints_digest(rows: Iterable[Iterable[int]]) -> str:
    return digest(np.asarray(list(r), dtype=np.int64).tobytes() for r in rows)


def floats_digest(rows: Iterable[Iterable[float]]) -> str:
    return digest(np.asarray(list(r), dtype=np.float32).tobytes() for r in rows)


def params_digest(model: torch.nn.Module) -> str:
    return digest(
        name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes()
        for name, p in sorted(model.state_dict().items())
    )
