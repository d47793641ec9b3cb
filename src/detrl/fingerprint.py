"""Short hex digests of exact bytes: two runs are identical up to step t iff these match up to t."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import xxhash


def digest(chunks: Iterable[bytes]) -> str:
    """16 hex chars of xxh3-64 over length-prefixed chunks (fast: the params digest runs every step)."""
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def ints_digest(rows: Iterable[Iterable[int]]) -> str:
    return digest(np.asarray(list(r), dtype=np.int64).tobytes() for r in rows)


def floats_digest(rows: Iterable[Iterable[float]]) -> str:
    return digest(np.asarray(list(r), dtype=np.float32).tobytes() for r in rows)


def params_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """Over a module's state dict, or a state dict (e.g. the full one gathered from FSDP2 shards)."""
    state = model if isinstance(model, dict) else model.state_dict()
    return digest(
        name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes()
        for name, p in sorted(state.items())
    )
