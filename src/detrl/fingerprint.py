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


def params_digest(model: torch.nn.Module) -> str:
    return digest(
        name.encode() + (_device_bytes(p) if p.is_cuda else p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for name, p in sorted(model.state_dict().items())
    )


def _device_bytes(t: torch.Tensor, chunk: int = 1 << 27) -> bytes:
    """24 bytes standing for a GPU tensor's exact bytes, computed on its device (a host copy of a 0.6B
    model's float32 weights took ~1 s a step): the element count and two sums mod 2**64 of its 32-bit words,
    weighted by odd multipliers of their index (2i+1, and 2 x hash(i) + 1): changing any one word changes
    both sums. CUDA runs compare with CUDA runs only."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    words = torch.nn.functional.pad(raw, (0, -raw.numel() % 4)).view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), chunk):
        w = words[lo : lo + chunk].to(torch.int64)
        idx = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=t.device)
        s1 += (w * (2 * idx + 1)).sum()
        s2 += (w * ((idx * 0x7E3779B97F4A7C15 >> 17) | 1)).sum()
    return np.array([t.numel(), s1.item(), s2.item()], dtype=np.int64).tobytes()
