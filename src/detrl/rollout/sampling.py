"""Token sampling by the Gumbel-max trick, with two noise sources.

`hashed_gumbel` draws each sample's noise from a counter-based hash of (sampling seed, absolute
position, vocab id), like SGLang's deterministic sampler: a sample's noise does not depend on
which batch, worker or step order produced it. `stream_gumbel` draws from one shared torch
generator in the order calls arrive, as engines without per-request seeds do.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
NOISE_CHUNK = 16  # positions whose seeded noise is hashed at once ...
NOISE_ELEMENTS = (
    2**22
)  # ... while [rows, positions, V] stays under this many values (a real vocab: 1 at a time)


def noise_chunk(rows: int, vocab: int) -> int:
    """Positions of noise to draw at once for `rows` rows over `vocab` (bounded memory)."""
    return max(1, min(NOISE_CHUNK, NOISE_ELEMENTS // (rows * vocab)))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): good avalanche, exact on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seeds: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per 64-bit sampling seed [B] (computed once per batch)."""
    return _mix32(_mix32(seeds & _M32) ^ _mix32((seeds >> 32) & _M32 ^ 0x9E3779B9))


def hashed_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int, key: torch.Tensor | None = None
) -> torch.Tensor:
    """U(0,1) [B, (T,) V] (float64) from (seed [B] int64, position [B] or [B, T] int64, vocab id)."""
    s = seed_key(seeds) if key is None else key  # [B]
    if positions.dim() == 2:
        s = s[:, None]  # [B, 1]
    h = _mix32((s + _mix32(positions & _M32)) & _M32)  # [B] or [B, T]
    h = _mix32((h[..., None] + _vocab_key(vocab, s.device)) & _M32)  # [B, (T,) V]
    return (h.double() + 0.5) / 2.0**32


_VOCAB_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_key(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _VOCAB_KEYS:
        _VOCAB_KEYS[key] = _mix32(torch.arange(vocab, dtype=torch.int64, device=device) + 0x632BE5AB)
    return _VOCAB_KEYS[key]


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def hashed_gumbel(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int, key: torch.Tensor | None = None
) -> torch.Tensor:
    return gumbel(hashed_uniform(seeds, positions, vocab, key))


def stream_gumbel(generator: torch.Generator, lead: tuple[int, ...], vocab: int) -> torch.Tensor:
    """Gumbel noise [*lead, V] from the next draws of a shared generator (whoever calls first gets them), on the
    generator's device."""
    u = torch.rand(*lead, vocab, generator=generator, dtype=torch.float64, device=generator.device)
    u = u.clamp_min(1e-300)
    return gumbel(u)


def top_p_mask(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for tokens inside the nucleus (the smallest prefix by prob with mass >= top_p). [B, V]."""
    if top_p >= 1.0:
        return torch.ones_like(logp, dtype=torch.bool)
    probs = logp.exp()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the first token is always kept
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample(logp: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    """argmax(logp + gumbel) over the nucleus: a draw from softmax restricted to top-p. -> [B]."""
    scores = logp.double() + noise
    if top_p < 1.0:
        scores = scores.masked_fill(~top_p_mask(logp, top_p), float("-inf"))
    return scores.argmax(dim=-1)
