"""What a run logs about itself each step so that runs can be compared after the fact.

Fingerprints (`fp/*`): short hex digests of exact bytes: two runs are identical up to step t iff these
match up to t. The content fingerprints (`fp/rollout_tokens`, `fp/rollout_logprobs`) hash each sample
keyed by (prompt uid, sample index) and combine them in that key's order, so they do not depend on the
order the batch came in; `fp/batch_order` hashes that order alone. A pure reordering therefore changes
`fp/batch_order` only.

Drift sketches (`drift.jsonl`, one line per step, not W&B scalars): how far two runs are apart, not only
whether they differ. `param_sketch` is a fixed random projection R x of the flattened parameters x
(SKETCH_DIM numbers; the same R in every run), so ||R x_a - R x_b|| estimates ||x_a - x_b|| for any two
runs (Johnson-Lindenstrauss). R is never materialised: R = G S / sqrt(k) with S a random-sign fold of
x into FOLD buckets (coordinate i -> bucket i mod FOLD, sign +-1) and G a k x FOLD Gaussian, so a step
costs one pass over the parameters plus a (k x FOLD) matvec. `logprob_sketch` projects the per-prompt
mean rollout logprob, keyed by prompt uid (each uid its own seeded Gaussian column), so runs that saw
their groups in other orders, or other groups, compare too.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import xxhash

SKETCH_DIM = (
    256  # numbers per sketch: the distance estimate's relative error is ~1/sqrt(2 * 256) = 4.4% (1 sd)
)
FOLD = 4096  # buckets of the random-sign fold before the Gaussian projection
SKETCH_SEED = 20261201  # fixed: every run projects with the same matrix
DRIFT_FILE = "drift.jsonl"


def digest(chunks: Iterable[bytes]) -> str:
    """16 hex chars of xxh3-64 over length-prefixed chunks (fast: the params digest runs every step)."""
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def ints_digest(rows: Iterable[Iterable[int]]) -> str:
    return digest(np.asarray(list(r), dtype=np.int64).tobytes() for r in rows)


def params_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """Over a module's state dict, or a state dict (e.g. the full one gathered from FSDP2 shards). GPU tensors are
    summed on their device (`_device_words`) and copied to the host together: one sync a call, not two a tensor."""
    state = sorted((model if isinstance(model, dict) else model.state_dict()).items())
    on_device = [_device_words(p) for _, p in state if p.is_cuda]
    host = iter(torch.stack(on_device).cpu().numpy() if on_device else ())
    return digest(
        name.encode() + (next(host).tobytes() if p.is_cuda else _host_bytes(p)) for name, p in state
    )


def _host_bytes(p: torch.Tensor) -> bytes:
    return p.detach().contiguous().view(torch.uint8).numpy().tobytes()


class StreamDigest:
    """`params_digest` over (name, tensor) pairs that pass one at a time in sorted name order (a sharded model's
    parameters gathered one by one): the same hex digest as over the whole state dict, no tensor kept."""

    def __init__(self):
        self._h = xxhash.xxh3_64()

    def pass_through(self, items: Iterable[tuple[str, torch.Tensor]]):
        """Yield the pairs unchanged, hashing each as it goes by."""
        for name, p in items:
            body = _device_words(p).cpu().numpy().tobytes() if p.is_cuda else _host_bytes(p)
            chunk = name.encode() + body
            self._h.update(len(chunk).to_bytes(8, "little"))
            self._h.update(chunk)
            yield name, p

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _device_words(t: torch.Tensor, chunk: int = 1 << 27) -> torch.Tensor:
    """3 int64 standing for a GPU tensor's exact bytes, computed on its device (a host copy of a 0.6B model's
    float32 weights took ~1 s a step): the element count and two sums mod 2**64 of its 32-bit words, weighted by
    odd multipliers of their index (2i+1, and 2 x hash(i) + 1): changing any one word changes both sums. CUDA
    runs compare with CUDA runs only. No host sync."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    words = torch.nn.functional.pad(raw, (0, -raw.numel() % 4)).view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), chunk):
        w = words[lo : lo + chunk].to(torch.int64)
        idx = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=t.device)
        s1 += (w * (2 * idx + 1)).sum()
        s2 += (w * ((idx * 0x7E3779B97F4A7C15 >> 17) | 1)).sum()
    return torch.stack([s1.new_full((), t.numel()), s1, s2])


def keyed_digest(items: Iterable[tuple[tuple[int, int], np.ndarray]]) -> str:
    """Order-independent: each (key, content) hashed as one record, the records taken in key order."""
    return digest(
        struct.pack("<qq", *key) + content.tobytes() for key, content in sorted(items, key=lambda x: x[0])
    )


def rollout_fingerprints(results) -> dict[str, str]:
    """fp/batch_order (the order of (prompt uid, sample index) in the batch) and the content digests
    fp/rollout_tokens / fp/rollout_logprobs, which do not depend on that order.

    >>> from detrl.rollout.base import Request, Result
    >>> a = [Result(Request(u, k, (1,)), [u + k], [-0.5], "stop") for u in (7, 3) for k in (0, 1)]
    >>> fa, fb = rollout_fingerprints(a), rollout_fingerprints(a[::-1])
    >>> fa["fp/rollout_tokens"] == fb["fp/rollout_tokens"], fa["fp/batch_order"] == fb["fp/batch_order"]
    (True, False)
    """
    results = list(results)
    return {
        "fp/batch_order": ints_digest([r.uid for r in results]),
        "fp/rollout_tokens": keyed_digest((r.uid, np.asarray(r.tokens, dtype=np.int64)) for r in results),
        "fp/rollout_logprobs": keyed_digest(
            (r.uid, np.asarray(r.logprobs, dtype=np.float32)) for r in results
        ),
    }


# ---------------------------------------------------------------- drift sketches


class _Projection:
    """R = G S / sqrt(k) for one parameter layout: S the random-sign fold (n -> FOLD), G Gaussian [k, FOLD].

    The signs are drawn once from the seeded generator and kept bit-packed (n / 8 bytes, not the n float64s
    of a dense matrix: 8 bytes a parameter on rank 0 was the largest host array of a run); each call folds
    the parameters _ROWS fold-rows at a time through one reused float64 block, so nothing of size n is held.
    Computed with numpy's single-threaded loops (einsum, no BLAS, no OpenMP): the same summation order on
    every machine and thread count, and no thread hand-offs on a busy CPU.
    """

    def __init__(self, numel: int, dim: int, fold: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.numel, self.fold = numel, fold
        rows = -(-numel // fold)
        bits = [  # the same draws as one randint call over [rows, fold], in row blocks
            np.packbits(torch.randint(0, 2, (min(_ROWS, rows - r), fold), generator=g).numpy().astype(bool))
            for r in range(0, rows, _ROWS)
        ]
        self.bits = bits
        self.gauss = (torch.randn(dim, fold, generator=g, dtype=torch.float64) / math.sqrt(dim)).numpy()
        self.block = np.zeros((_ROWS, fold), dtype=np.float64)  # one block of the flattened parameters

    def _blocks(self, tensors: list[torch.Tensor]):
        """Yield (block index, rows) of the zero-padded flattened parameters, _ROWS * fold elements a block."""
        flat, size, o, b = self.block.reshape(-1), self.block.size, 0, 0
        for t in tensors:
            # a float64 copy (numpy() of the parameter itself would pin its storage, which FSDP2 frees and
            # re-allocates); a host copy on GPUs
            a = t.detach().reshape(-1).to(device="cpu", dtype=torch.float64).numpy()
            i = 0
            while i < a.size:
                n = min(a.size - i, size - o)
                flat[o : o + n] = a[i : i + n]  # float32 -> float64 is exact
                o, i = o + n, i + n
                if o == size:
                    yield b, self.block
                    o, b = 0, b + 1
        if o:
            flat[o:] = 0.0
            yield b, self.block[: -(-o // self.fold)]

    def __call__(self, tensors: list[torch.Tensor]) -> tuple[np.ndarray, float]:
        """-> (the sketch [k], the exact L2 norm), block by block (sums in a fixed block order)."""
        folded, square = np.zeros(self.fold, dtype=np.float64), 0.0
        for b, rows in self._blocks(tensors):
            signs = np.unpackbits(self.bits[b])[: rows.size].reshape(rows.shape).astype(np.float64) * 2 - 1
            folded += np.einsum("ij,ij->j", rows, signs)
            square += float(np.einsum("ij,ij->", rows, rows))
        return np.einsum("kj,j->k", self.gauss, folded), math.sqrt(square)


_ROWS = 256  # fold-rows per host block: 1M float64s (8 MB) at FOLD = 4096


_K1, _K2 = -7046029254386353131, -4658895280553007687  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 as int64
_CHUNK = 1 << 24  # elements per device step (a multiple of FOLD)


def _hash_signs(index: torch.Tensor, seed: int) -> torch.Tensor:
    """+-1 (float64) as a function of (seed, the global parameter index): a multiply-xorshift hash in int64 (the
    products wrap), bit 40 of the result."""
    h = (index ^ seed) * _K1
    h = (h ^ (h >> 29)) * _K2
    return ((h >> 40) & 1).to(torch.float64) * 2 - 1


def device_sketch(
    tensors: Iterable[torch.Tensor], gauss: torch.Tensor, fold: int = FOLD, seed: int = SKETCH_SEED
) -> tuple[np.ndarray, float]:
    """The parameter sketch computed where the parameters are (no host copy of the model: on a 0.6B model the
    host path copied 2.4 GB and folded it in numpy every step): the same Gaussian projection of a random-sign
    fold, with the signs hashed from each element's global index, in float64 chunks aligned to the fold, so
    the result depends on the values alone (the same bits run to run; not equal to the host path's numbers)."""
    tensors = iter(tensors)  # read once: a sharded model's parameters are gathered as they are read
    first = next(tensors)
    dev = first.device
    folded = torch.zeros(fold, dtype=torch.float64, device=dev)
    square = torch.zeros((), dtype=torch.float64, device=dev)
    o = 0  # global index of the tensor's first element
    for t in itertools.chain([first], tensors):
        x = t.detach().reshape(-1)
        start = o - o % fold  # the chunk grid is global: chunks start at multiples of the fold
        for lo in range(start, o + x.numel(), _CHUNK):
            a, b = max(lo, o), min(lo + _CHUNK, o + x.numel())
            part = x[a - o : b - o].to(torch.float64)  # float32 -> float64 is exact
            square += part.square().sum()
            signed = part * _hash_signs(torch.arange(a, b, device=dev), seed)
            pad = torch.nn.functional.pad(signed, (a - lo, (-(b - lo)) % fold))  # aligned to fold columns
            folded += pad.view(-1, fold).sum(0)
        o += x.numel()
    sketch = gauss.to(dev) @ folded
    return sketch.cpu().numpy(), math.sqrt(square.item())


@lru_cache(maxsize=4)
def _device_gauss(dim: int, fold: int, seed: int) -> torch.Tensor:
    """The device path's Gaussian G [k, FOLD] (its signs are hashed, so nothing of size n is ever drawn)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(dim, fold, generator=g, dtype=torch.float64) / math.sqrt(dim)


@lru_cache(maxsize=8)
def _projection(layout: tuple[tuple[str, int], ...], dim: int, fold: int, seed: int) -> _Projection:
    return _Projection(sum(n for _, n in layout), dim, fold, seed)


def _params(model: torch.nn.Module) -> tuple[tuple[tuple[str, int], ...], list[torch.Tensor]]:
    params = sorted(model.named_parameters(), key=lambda x: x[0])
    return tuple((n, p.numel()) for n, p in params), [p for _, p in params]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """The trainable parameters in name order, flattened, float64 (exact for float32 weights)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in _params(model)[1]])


def param_sketch(
    model: torch.nn.Module,
    dim: int = SKETCH_DIM,
    fold: int = FOLD,
    seed: int = SKETCH_SEED,
    tensors: Iterable[torch.Tensor] | None = None,
) -> tuple[np.ndarray, float]:
    """(R x, ||x||) for the flattened parameters x: ||R x_a - R x_b|| ~ ||x_a - x_b|| for any two models of
    one layout (same names and sizes). tensors: the parameters in sorted name order, read once (e.g. a sharded
    model's, gathered one at a time); None: the model's own."""
    layout, own = _params(model)
    if tensors is None:
        tensors = own
    tensors = iter(tensors)
    first = next(tensors, None)
    tensors = itertools.chain([] if first is None else [first], tensors)
    with torch.no_grad():
        if (
            first is not None and first.is_cuda
        ):  # on the device: no host copy of the model, no n-sized host arrays
            return device_sketch(tensors, _device_gauss(dim, fold, seed), fold, seed)
        return _projection(layout, dim, fold, seed)(tensors)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uid_gaussians(uids: list[int], dim: int = SKETCH_DIM, seed: int = SKETCH_SEED) -> np.ndarray:
    """[len(uids), dim] N(0, 1) numbers, each row a pure function of (seed, uid): counter-based hash + Box-Muller."""
    u = np.asarray(uids, dtype=np.uint64)[:, None] & _M64
    base = _splitmix64(_splitmix64(u ^ np.uint64(seed)))  # [n, 1]
    j = np.arange(dim, dtype=np.uint64)[None, :]
    h1, h2 = _splitmix64(base + np.uint64(2) * j), _splitmix64(base + np.uint64(2) * j + np.uint64(1))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def uid_sketch(values: dict[int, float], dim: int = SKETCH_DIM, seed: int = SKETCH_SEED) -> np.ndarray:
    """sum_u values[u] g_u / sqrt(k), g_u ~ N(0, I_k) a function of (seed, u): a JL sketch of a vector indexed
    by uid (a uid missing from one run counts as 0 there). Summed in uid order: the same bits in any order."""
    out = np.zeros(dim)
    uids = sorted(values)
    if uids:
        g = uid_gaussians(uids, dim, seed) / math.sqrt(dim)
        for row, uid in zip(g, uids):
            out += values[uid] * row
    return out


def mean_logprob_by_uid(results) -> dict[int, float]:
    """Per prompt uid: the mean rollout logprob over its samples' response tokens (an exact sum: order-free)."""
    sums: dict[int, list[float]] = {}
    for r in results:
        sums.setdefault(r.request.prompt_uid, []).extend(r.logprobs)
    return {u: math.fsum(v) / len(v) for u, v in sums.items() if v}


def drift_step(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    results,
    tensors: Iterable[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Append this step's sketches to <run_dir>/drift.jsonl; -> {"drift/param_norm": exact L2 norm}. tensors:
    as `param_sketch`'s."""
    sketch, norm = param_sketch(model, tensors=tensors)
    record = {
        "step": step,
        "param_norm": norm,
        "param_sketch": sketch.tolist(),
        "logprob_sketch": uid_sketch(mean_logprob_by_uid(results)).tolist(),
    }
    with (Path(run_dir) / DRIFT_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")
    return {"drift/param_norm": norm}
