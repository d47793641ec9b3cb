"""The numerical kernels of the forward pass, in two sets.

`DEFAULT_OPS` are torch's defaults (F.linear, SDPA, F.silu, grouped MoE dispatch with index_add_), as
serving engines and trainers use them: a row's result can depend on how many rows share the call.
`BATCH_INVARIANT_OPS` compute every row the same way whatever its batch-mates, batch size, padding or
prefill/decode phase, so that the sampler and the trainer produce the same bits for the same token:
- matmul: the CPU gemm picks kernels by row count (calls with < 12 rows give other bits), so short
  calls are padded to ROW_TILE rows; a self-check per shape (`gemm_mode`) compares the calls against one
  thread's: shapes whose kernels split the K reduction over threads at some row counts run at one thread,
  and shapes that vary even there as fixed (ROW_TILE, K) x (K, N) tiles;
- attention: over the fixed key length ctx_len (masked keys at -inf), short query blocks padded like
  matmul rows, so prefill, decode and training reduce each row the same way; a decode step cuts the keys
  past its last live one only at widths a self-check per shape (`decode_attention.decode_widths`) proved
  give the full
  length's bits;
- silu: x / (1 + exp(-x)) (torch's fused silu rounds its vector tail differently);
- MoE: stable-sort routing (ties -> lowest expert id), grouped dispatch on bi_linear, combine in
  ascending expert id.
Measured on torch 2.13 CPU (AVX512): exp, log, rsqrt, sum(-1), log_softmax(-1) are row-invariant.
`CUDA_INVARIANT_OPS` are the same contract on CUDA as Triton kernels whose tiling depends on shapes, never on
the row count (`detrl.models.triton_ops`): graph-capturable, no host syncs, shared by the CUDA engine and
the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from detrl.models import primitives
from detrl.models.decode_attention import decode_attention, keys_to
from detrl.models.primitives import ROW_TILE, rms_norm
from detrl.models.primitives import pad_rows as _pad_rows

_ROW_INVARIANT: dict[tuple[int, int, torch.dtype, str, int], str] = {}
PROBE_ROWS = 512  # the probe's largest call; its sub-calls below cover each kernel regime met on 2-16 threads
PROBE_SPANS = (16, 17, 23, 31, 32, 33, 64, 95, 128, 200, 257)


@contextlib.contextmanager
def one_thread():
    """Run the enclosed ops at one intra-op thread (this process's count restored after): the count the
    rollout workers run at, and the one where the CPU gemm's kernels never split the K reduction over threads."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _tiled_linear(x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows padded to a multiple of ROW_TILE, run as a bmm of fixed (ROW_TILE, K) x (K, N) tiles: at one thread
    every tile is the same gemm call, so a row's bits do not depend on the others (at several threads the bmm's
    split over the tiles, hence the kernels, changes with their number)."""
    m, k = x2d.shape
    padded = -(-m // ROW_TILE) * ROW_TILE
    tiles = F.pad(x2d, (0, 0, 0, padded - m)).view(padded // ROW_TILE, ROW_TILE, k)  # [M/R, R, K]
    out = torch.bmm(tiles, w.t().unsqueeze(0).expand(tiles.shape[0], k, w.shape[0]))  # [M/R, R, N]
    return out.reshape(padded, w.shape[0])[:m]


def _agrees(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> bool:
    """Does F.linear (and the batched matmul) at this thread count give each row `ref`'s bits for every span?"""
    k, n = x.shape[1], w.shape[0]
    xb, wb, refb = x[:300].view(3, 100, k), w.t().expand(3, k, n), ref[:300].view(3, 100, n)
    return (
        torch.equal(F.linear(x, w), ref)
        and all(torch.equal(F.linear(x[o : o + m], w), ref[o : o + m]) for m in PROBE_SPANS for o in (0, 5))
        and all(
            torch.equal(torch.matmul(xb[:, o : o + m], wb), refb[:, o : o + m])
            for m in PROBE_SPANS[:8]
            for o in (0, 5)
        )
    )


def gemm_mode(k: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """Measure once per shape how a (M, K) x (K, N) gemm gives each row the bits of a one-thread tiled call
    (`_tiled_linear`, what the rollout workers' single thread computes) for any row count >= ROW_TILE:
    "fast" F.linear and matmul at this process's thread count do; "serial" they do at one thread (on 2 threads
    the CPU gemm splits the K reduction for some shapes and row counts: K=2048, N=768 at <= 256 rows, measured
    on a Xeon); "tiled" neither (`_tiled_linear` at one thread). Measured on, and cached for, the device of the
    call and this thread count (a CPU measurement never certifies a GPU)."""
    device = torch.device(device)
    place = f"{device.type}:{device.index or 0}" if device.type != "cpu" else "cpu"
    key = (k, n, dtype, place, torch.get_num_threads())
    if key not in _ROW_INVARIANT:
        g = torch.Generator().manual_seed(k * 7919 + n)
        x, w = (torch.randn(shape, generator=g).to(device, dtype) for shape in ((PROBE_ROWS, k), (n, k)))
        with torch.no_grad():
            with one_thread():
                ref = _tiled_linear(x, w)
                serial = _agrees(x, w, ref)
            fast = serial and (torch.get_num_threads() == 1 or _agrees(x, w, ref))
            _ROW_INVARIANT[key] = "fast" if fast else "serial" if serial else "tiled"
    return _ROW_INVARIANT[key]


def gemm_modes() -> dict[str, str]:
    """The CPU gemm modes measured so far at this thread count: "K x N dtype" -> fast | serial | tiled (what the
    batch-invariant linear runs for that shape here; it differs between CPUs)."""
    n = torch.get_num_threads()
    return {
        f"{k} x {w} {str(dt).removeprefix('torch.')}": mode
        for (k, w, dt, place, threads), mode in sorted(_ROW_INVARIANT.items(), key=str)
        if place == "cpu" and threads == n
    }


def _gemm_is_row_invariant(k: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether F.linear and matmul at this thread count are row-invariant for this shape (`gemm_mode`)."""
    return gemm_mode(k, n, dtype, device) == "fast"


def bi_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with per-row results independent of the number of rows (and equal to one thread's). x (..., K),
    w (N, K)."""
    k = x.shape[-1]
    mode = gemm_mode(k, w.shape[0], x.dtype, x.device)
    if mode == "fast" and x.numel() >= ROW_TILE * k:
        return F.linear(x, w)
    rows = x.reshape(-1, k)  # [M, K]
    if mode == "tiled":
        with one_thread():
            out = _tiled_linear(rows, w)
    elif mode == "serial":
        with one_thread():
            out = F.linear(rows if rows.shape[0] >= ROW_TILE else _pad_rows(rows), w)[: rows.shape[0]]
    else:
        out = F.linear(_pad_rows(rows), w)[: rows.shape[0]]
    return out.reshape(*x.shape[:-1], w.shape[0])


def _bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with short M padded to ROW_TILE rows (see _gemm_is_row_invariant)."""
    m = a.shape[-2]
    if m >= ROW_TILE:
        return torch.matmul(a, b)
    return torch.matmul(_pad_rows(a), b)[..., :m, :]


def bi_silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def query_chunked(attn: Callable, q, k, v, mask, scale: float, chunk: int) -> torch.Tensor:
    """attn over the query rows in pieces of `chunk`, each recomputed in the backward (torch's checkpoint): the
    backward holds one piece's [B, H, chunk, L] scores and probabilities, never [B, H, T, L]. For a row-invariant
    attn (each query row reduced on its own) the output is the same bits as one call."""
    outs = []
    for lo in range(0, q.shape[2], chunk):
        rows = mask[:, :, lo : lo + chunk] if mask.shape[2] > 1 else mask
        outs.append(checkpoint(attn, q[:, :, lo : lo + chunk], k, v, rows, scale, use_reentrant=False))
    return torch.cat(outs, dim=2)


def bi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Batch-invariant attention (`bi_attention_rows`); a training pass longer than ATTN_QUERY_CHUNK query rows runs
    in recomputed pieces of that many rows (`query_chunked`: the same bits, memory bounded in the backward)."""
    chunk = primitives.ATTN_QUERY_CHUNK
    if q.shape[2] > chunk and torch.is_grad_enabled():
        return query_chunked(bi_attention_rows, q, k, v, mask, scale, chunk)
    return bi_attention_rows(q, k, v, mask, scale)


def bi_attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, Hkv, L' <= L, D), mask (B or 1, 1, T, L) True = attend -> (B, H, T, D). Keys
    past the first L' are zeros the mask hides (a paged decode step gathers no more than it needs).

    Always over the full key length L with masked keys at -inf, so prefill, decode and training
    reduce over the same row. Grouped-query heads share their key/value head without a copy: the
    rep query heads of a group are stacked as rows. Matmuls where the gemm is row-invariant, else
    explicit row sums. (torch's fused CPU attention is row-invariant for query blocks of >= ROW_TILE
    rows, but a decode step padded to that many rows runs ~5x slower in it than these matmuls.)
    """
    b, h, t, d = q.shape
    hkv, length = k.shape[1], mask.shape[-1]
    rep = h // hkv
    q = q.reshape(b, hkv, rep * t, d)  # rows (r, t) of each kv group
    fast = _gemm_is_row_invariant(d, length, q.dtype, q.device) and _gemm_is_row_invariant(
        length, d, q.dtype, q.device
    )
    if fast and t == 1 and rep < ROW_TILE:  # a decode step: its rep rows share one mask row
        return decode_attention(q, k, v, mask, scale).reshape(b, h, t, d)
    k, v = keys_to(k, length), keys_to(v, length)
    if fast:
        scores = _bi_matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, rep T, L]
    else:
        scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale  # [B, Hkv, rep T, L]
    scores = scores.view(b, hkv, rep, t, length).masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, rep * t, length)
    if fast:
        out = _bi_matmul(probs, v)  # [B, Hkv, rep T, D]
    else:
        out = (probs.unsqueeze(-2) * v.transpose(-1, -2).unsqueeze(-3)).sum(-1)  # [B, Hkv, rep T, D]
    return out.reshape(b, h, t, d)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def cuda_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention for CUDA's default op set, by the forward's contract: T > 1 query rows sit at positions
    0..T-1 (training, prefill), so they attend causally to the first T keys (flash attention, no mask);
    a decode step (T == 1) attends to the whole fixed key length under its mask, as two batched gemms
    with the grouped-query heads of a kv head stacked as rows (no copy of the cache)."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if t > 1:
        return F.scaled_dot_product_attention(
            q, k[:, :, :t], v[:, :, :t], is_causal=True, scale=scale, enable_gqa=h != hkv
        )
    scores = (
        torch.matmul(q.view(b, hkv, h // hkv, d), k.transpose(-1, -2)).float() * scale
    )  # [B, Hkv, rep, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)  # mask [B, 1, 1, L]
    return torch.matmul(probs, v).view(b, h, 1, d)


def route_topk(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's routing (fp32 softmax, torch.topk: ties broken however the kernel does)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E]
    top_i = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
    return _weights_at(probs, top_i, norm_topk_prob, router_logits.dtype), top_i


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in fp32; a stable sort makes ties go to the lowest expert id. -> (weights, ids) [N, k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E]
    top_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [N, k]
    return _weights_at(probs, top_i, norm_topk_prob, router_logits.dtype), top_i


def routing_weights(router_logits: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The weights `route` gives experts `ids` [N, k] (MoE routing replay: ids chosen elsewhere, e.g. by the
    rollout engine): the fp32 softmax over all E router logits, taken at ids, renormalised over the k when
    norm_topk_prob, in the logits' dtype. For route's own ids: route's weights, bit for bit. -> [N, k]"""
    return _weights_at(torch.softmax(router_logits.float(), dim=-1), ids, norm_topk_prob, router_logits.dtype)


def _weights_at(
    probs: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool, dtype: torch.dtype
) -> torch.Tensor:
    """probs [N, E] at ids [N, k] (a gather copies the values sort / topk return), renormalised if asked."""
    top_w = probs.gather(-1, ids)  # [N, k]
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(dtype)


def moe_dispatch(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """Gather each expert's rows, run them as one call, add back with index_add in ascending expert id.

    With default kernels an expert's output for a token depends on how many tokens share the call;
    with bi_linear it does not, and the ascending combine fixes each token's summation order.
    x [N, H] -> [N, H].
    """
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():  # sorted
        token_idx, slot = torch.where(top_i == e)
        gate, up = linear(x[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = linear(silu(gate) * up, down[e]) * top_w[token_idx, slot, None]
        out = out.index_add(0, token_idx, y)
    return out


def grouped_moe(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """moe_dispatch with static shapes and no host sync (CUDA graphs can capture it): the N k (token,
    expert) pairs sorted by expert run as two grouped gemms (torch._grouped_mm over per-expert offsets),
    and each token sums its k expert outputs in slot order (no atomics). `linear` is unused: the grouped
    gemm is the op. x [N, H] -> [N, H].
    """
    n, k = top_i.shape
    experts = gate_up.shape[0]
    flat = top_i.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # [N k] pairs grouped by expert, ascending
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )  # [E]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end of each expert's rows
    xs = x[order // k]  # [N k, H]
    gate, up = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # [N k, I] each
    ys = torch._grouped_mm(silu(gate) * up, down.transpose(-2, -1), offs=offs)  # [N k, H]
    y = torch.empty_like(ys).index_copy_(0, order, ys).view(n, k, -1)  # back to (token, slot) order
    return (y * top_w.unsqueeze(-1).to(y.dtype)).sum(1)


def _triton(name: str) -> Callable:
    """triton_ops.<name>, imported at the first call (CPU-only installs need not have Triton)."""

    def op(*args):
        from detrl.models import triton_ops

        return getattr(triton_ops, name)(*args)

    op.__name__ = op.__qualname__ = f"triton_{name}"
    return op


@dataclass(frozen=True)
class Ops:
    """A forward's numerics: the kernels (norm: RMSNorm), the MoE dispatch, the compute dtype of the weights (None: the
    model's own) and whether the trainer recomputes each layer in the backward (activation checkpointing).
    Fused kernels where a set has them (None: the forward composes the ops above): linear_add(x, w, r) = r +
    linear(x, w); silu_mul(x) = silu(gate) * up of x = [gate | up]; norm_rope(x, w, eps, cos, sin) = the q/k
    heads' norm then rope."""

    name: str
    linear: Callable
    silu: Callable
    attention: Callable
    route: Callable
    moe: Callable = moe_dispatch
    norm: Callable = rms_norm
    dtype: torch.dtype | None = None
    checkpoint: bool = False
    linear_add: Callable | None = None
    silu_mul: Callable | None = None
    norm_rope: Callable | None = None


DEFAULT_OPS = Ops("default", F.linear, F.silu, sdpa_attention, route_topk)
BATCH_INVARIANT_OPS = Ops("batch_invariant", bi_linear, bi_silu, bi_attention, route)
# CUDA: torch's kernels, with the MoE as grouped gemms (static shapes, no host sync: graph-capturable)
CUDA_DEFAULT_OPS = Ops("cuda_default", F.linear, F.silu, cuda_attention, route_topk, moe=grouped_moe)
# CUDA, determinism on: batch-invariant Triton kernels (F.silu is elementwise: invariant as it is)
CUDA_INVARIANT_OPS = Ops(
    "cuda_invariant",
    _triton("linear"),
    F.silu,
    _triton("attention"),
    route,
    moe=_triton("moe"),
    norm=_triton("rms_norm"),
    linear_add=_triton("linear_add"),
    silu_mul=_triton("silu_mul"),
    norm_rope=_triton("norm_rope"),
)

# (device type, batch-invariant kernels) -> the op set
OP_SETS: dict[tuple[str, bool], Ops] = {
    ("cpu", False): DEFAULT_OPS,
    ("cpu", True): BATCH_INVARIANT_OPS,
    ("cuda", False): CUDA_DEFAULT_OPS,
    ("cuda", True): CUDA_INVARIANT_OPS,
}


def select_ops(
    device_type: str,
    invariant_kernels: bool,
    stable_routing: bool,
    dtype: torch.dtype = torch.float32,
    checkpoint: bool = False,
) -> Ops:
    """The op set for a device, kernel choice and MoE routing (CPU, float32, no recomputation: the sets
    themselves, so the CPU default's bits never move)."""
    if (device_type, invariant_kernels) not in OP_SETS:
        raise ValueError(
            f"no op set for device={device_type!r}; choose one of {sorted({d for d, _ in OP_SETS})}"
        )
    base = OP_SETS[(device_type, invariant_kernels)]
    changes: dict = {}
    routing = route if stable_routing else route_topk
    if base.route is not routing:
        changes["route"] = routing
    if dtype != torch.float32 or checkpoint:
        changes.update(dtype=dtype, checkpoint=checkpoint)
    return dataclasses.replace(base, **changes) if changes else base
