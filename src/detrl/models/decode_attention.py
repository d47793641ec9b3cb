"""The batch-invariant attention of one decode step (`ops.bi_attention`'s fast path for one query position) and
the self-check that lets it read fewer keys than the fixed key length: a width is used only where a probe per
shape measured the narrower call to give the full length's bits (masked keys add exact zeros; what can change
is the CPU kernels' blocking with the key count, hence the probe, not an argument)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detrl.models.primitives import ROW_TILE, pad_rows

_DECODE_WIDTHS: dict[tuple[int, int, torch.dtype, str, int], tuple[int, ...]] = {}
DECODE_WIDTH_STEPS = 64  # the most key widths a decode shape's probe checks (ROW_TILE apart, or wider)


def decode_attention(q, k, v, mask, scale) -> torch.Tensor:
    """ops.bi_attention's fast path for one query position: q (B, Hkv, rep, D) -> (B Hkv, rep, D), the gemms
    as bmm on rows padded to ROW_TILE, mask and softmax on the rep real rows only. The keys past the last
    one any row attends to are cut off where `decode_widths` measured the narrower call to give the full
    length's bits (masked keys add exact zeros; what can change is the kernels' blocking, hence the probe)."""
    width = decode_width(q.shape[-1], mask.shape[-1], q.dtype, q.device, _live_keys(mask))
    return decode_rows(q, keys_to(k, width), keys_to(v, width), mask[..., :width], scale)


def keys_to(k: torch.Tensor, width: int) -> torch.Tensor:
    """k [B, Hkv, L', D] as its first `width` keys: cut, or padded with zero keys (the masked ones)."""
    have = k.shape[-2]
    if have == width:
        return k
    return k[:, :, :width] if have > width else F.pad(k, (0, 0, 0, width - have))


def _live_keys(mask: torch.Tensor) -> int:
    """1 + the last key position any row attends to (mask [B, 1, 1, L])."""
    cols = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else 1


def decode_width(d: int, length: int, dtype: torch.dtype, device: torch.device | str, live: int) -> int:
    """The narrowest key width >= live that `decode_widths` admits for (d, length)."""
    for w in decode_widths(d, length, dtype, device):
        if w >= live:
            return w
    return length


def decode_widths(
    d: int, length: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[int, ...]:
    """Measure once per shape which key widths w < length give a decode step over the first w keys
    (`decode_rows`) the bits of the full-length call when every key past w is masked: candidates are
    multiples of ROW_TILE (at most DECODE_WIDTH_STEPS of them), each checked on random rows whose last
    attended key is at w and at w - 7, against the full call with other data in the masked tail. Cached
    per device and thread count like `gemm_mode`; the full length is always admitted."""
    device = torch.device(device)
    place = f"{device.type}:{device.index or 0}" if device.type != "cpu" else "cpu"
    key = (d, length, dtype, place, torch.get_num_threads())
    if key not in _DECODE_WIDTHS:
        step = max(ROW_TILE, -(-length // (DECODE_WIDTH_STEPS * ROW_TILE)) * ROW_TILE)
        g = torch.Generator().manual_seed(d * 7919 + length)
        q, k, v = (
            torch.randn(shape, generator=g).to(device, dtype)
            for shape in ((4, 1, 2, d),) + ((4, 1, length, d),) * 2
        )
        with torch.no_grad():
            ok = tuple(w for w in range(step, length, step) if _width_agrees(q, k, v, w)) + (length,)
        _DECODE_WIDTHS[key] = ok
    return _DECODE_WIDTHS[key]


def _width_agrees(q, k, v, w: int) -> bool:
    pos = torch.arange(k.shape[-2], device=k.device)
    for live in (w, max(1, w - 7)):
        mask = (pos < live).view(1, 1, 1, -1).expand(q.shape[0], 1, 1, -1)
        full = decode_rows(q, k, v, mask, 0.125)
        if not torch.equal(decode_rows(q, k[:, :, :w], v[:, :, :w], mask[..., :w], 0.125), full):
            return False
    return True


def decode_rows(q, k, v, mask, scale) -> torch.Tensor:
    b, hkv, rep, d = q.shape
    length = k.shape[-2]
    rows = pad_rows(q.reshape(b * hkv, rep, d))  # [B Hkv, R, D]
    scores = torch.bmm(rows, k.view(b * hkv, length, d).transpose(1, 2))[:, :rep] * scale  # [B Hkv, rep, L]
    scores = scores.view(b, hkv, rep, length).masked_fill(~mask, float("-inf"))  # mask [B, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).view(b * hkv, rep, length)
    return torch.bmm(pad_rows(probs), v.view(b * hkv, length, d))[:, :rep]
