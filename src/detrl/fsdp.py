"""FSDP2 over detrl's models as torchtitan applies it: `fully_shard` on each decoder block, then on the root.

Each block is its own parameter group (its own all-gather); the root's group holds what is left (embedding,
final norm, lm_head). Mixed precision: the functional forward's gathers (below) carry the matrices in the compute
dtype (bf16 on GPUs: half the bytes of an fp32 gather, the same bits as casting after it) and its gradients are
reduced in fp32; the modules' own forward (FSDP2's hooks, `param_dtype`) gathers in the compute dtype on GPUs
under `off`, in fp32 on CPU and under `on`. The weight sync and `fp/params` read the parameters one at a time (`full_items`): at most one full
tensor exists at once, never the full model.

detrl's functional forward reads a sharded model through `Gather` (`gather_root`, `gather_block`): one group's
local shards in, its full tensors out (one all-gather), and in the backward the group's full gradients handed to
the model's reducer (`reducing`), which sends them to their owners. At most one block (plus the root group) is
gathered at a time: the forward gathers each block inside its checkpointed layer, the backward again.

No import of detrl here (distributed.py re-exports these): the mesh is torch's, over the default group.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from detrl.device import trim_host_memory

_MESH = None


def mesh(device: torch.device):
    """The 1-D device mesh over every rank (one per device type, built once)."""
    global _MESH
    if _MESH is None or _MESH.device_type != device.type:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESH


def param_dtype(
    device_type: str, compute: torch.dtype | None, ordered: bool, master: torch.dtype
) -> torch.dtype:
    """The dtype FSDP2 gathers parameters in: the compute dtype on GPUs under `off` (torchtitan's bf16 params);
    the masters' own on CPU and under the ordered reduce (`on`: the bits must not depend on sharding)."""
    if device_type == "cuda" and not ordered and compute is not None:
        return compute
    return master


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks FSDP2 shards one by one (a Qwen3 model's `model.layers`; none for other modules)."""
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", []))


def shard(
    model: torch.nn.Module,
    compute: torch.dtype | None = None,
    ordered: bool = True,
    device: torch.device | str | None = None,
) -> None:
    """`fully_shard` on each block, then the root (in place): torchtitan's parallelize order. detrl's functional
    forward runs no module hooks: it gathers each group itself (`Gather`, in the shards' fp32); the modules' own
    forward (layer digests) gathers and frees one block at a time through FSDP2's hooks (in `param_dtype`).
    device: the run's device, for a model on the meta device (sharded before `to_empty`); None: the model's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype(device.type, compute, ordered, p.dtype), reduce_dtype=torch.float32
    )
    m = mesh(device)
    for block in blocks(model):
        fully_shard(block, mesh=m, mp_policy=mp)
    fully_shard(model, mesh=m, mp_policy=mp)


def shard_rows(d0: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) rows of each rank's dim-0 shard (torch.chunk's cut, as FSDP2's Shard(0); trailing ranks empty)."""
    c = -(-d0 // world)
    return [(min(r * c, d0), min((r + 1) * c, d0)) for r in range(world)]


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def groups(model) -> list:
    """Every FSDP2 module of the tree (the blocks, then the root), in a fixed order; [] for a plain module."""
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        return []
    inner = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    return [*inner, model]


def unshard(model) -> None:
    """Every group's full parameters all-gathered (each group one all-gather; inspection only: the trainer's
    passes gather one block at a time through `Gather`). Collective."""
    for g in groups(model):
        g.unshard()


def reshard(model) -> None:
    """Every group back to its shards (the gathered parameters freed)."""
    for g in groups(model):
        g.reshard()


def full_items(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the state dict in sorted name order (`params_digest`'s), each gathered alone when
    sharded and dropped once the consumer moves on: at most one full parameter at a time. Collective: every
    rank must consume the whole iterator."""
    from torch.distributed.tensor import DTensor

    sd = model.state_dict()  # DTensor shards: no gather yet
    for name in sorted(sd):
        v = sd[name]
        yield name, (v.full_tensor() if isinstance(v, DTensor) else v)
    trim_host_memory()  # the gathered parameters' pages (see Gather.forward)


def full_params(model) -> Iterator[torch.Tensor]:
    """The trainable parameters in sorted name order (the drift sketch's), full, gathered one at a time when
    sharded. Collective: every rank must consume the whole iterator."""
    from torch.distributed.tensor import DTensor

    for _, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        yield p.full_tensor() if isinstance(p, DTensor) else p
    trim_host_memory()


# --- per-group gathers for the functional forward ----------------------------------------------------------


class Gathers:
    """A model's gathered parameters now alive and their high-water marks (elements, bytes), and the reducer the
    backward hands gradients to (None outside `reducing`: no backward through the gathers)."""

    def __init__(self):
        self.live = self.peak = self.live_bytes = self.peak_bytes = 0
        self.reducer = None

    def track(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            n, b = t.numel(), t.numel() * t.element_size()
            self.live, self.live_bytes = self.live + n, self.live_bytes + b
            weakref.finalize(t, self._drop, n, b)
        self.peak, self.peak_bytes = max(self.peak, self.live), max(self.peak_bytes, self.live_bytes)

    def _drop(self, n: int, b: int) -> None:
        self.live, self.live_bytes = self.live - n, self.live_bytes - b


def gathers(model) -> Gathers:
    """The model's own `Gathers` (made on first use; one per model, no state shared across models)."""
    g = model.__dict__.get("_detrl_gathers")
    if g is None:
        g = model.__dict__["_detrl_gathers"] = Gathers()
    return g


@contextlib.contextmanager
def reducing(model, reducer):
    """For the block: backwards through `model`'s gathers hand their full gradients to `reducer`
    (`reducer.reduce_group(params, grads)` -> each local shard's gradient, or None)."""
    g = gathers(model)
    g.reducer = reducer
    try:
        yield
    finally:
        g.reducer = None


def _all_gather(shards: tuple[torch.Tensor, ...], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Full tensors from every rank's dim-0 shards (torch.chunk's cut, as FSDP2's Shard(0)): each shard padded
    to ceil(d0 / W) rows, one flat all-gather for the group, then trimmed."""
    world = dist.get_world_size()
    sizes = [-(-s[0] // world) * math.prod(s[1:]) for s in shapes]
    flat = torch.cat([F.pad(t.reshape(-1), (0, n - t.numel())) for t, n in zip(shards, sizes)])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    out, lo = [], 0
    for s, n in zip(shapes, sizes):
        rows, rest = -(-s[0] // world), math.prod(s[1:])
        held = [min(rows, max(0, s[0] - r * rows)) * rest for r in range(world)]  # rank r's shard, unpadded
        out.append(torch.cat([p[lo : lo + k] for p, k in zip(parts, held)]).view(s))
        lo += n
    return out


def gather_cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A shard as it is gathered: matrices (dim >= 2) in the compute dtype, before the all-gather (half the bytes
    and the traffic in bf16; the same bits as casting the gathered tensor, and their gradients the same values:
    each is used once, its gradient summed nowhere before the reducer's fp32); vectors (norms) in their own
    dtype, cast after the fuse as before (q/k norms are expanded per head: their gradients sum there)."""
    return t if dtype is None or t.dim() < 2 or t.dtype == dtype else t.to(dtype)


def _gather_by_dtype(shards: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """`_all_gather` once per dtype among the shards (matrices in the compute dtype, vectors in fp32), in order."""
    out: list = [None] * len(shards)
    for dt in dict.fromkeys(t.dtype for t in shards):
        idx = [i for i, t in enumerate(shards) if t.dtype == dt]
        for i, t in zip(idx, _all_gather(tuple(shards[i] for i in idx), [shapes[i] for i in idx])):
            out[i] = t
    return out


class Gather(torch.autograd.Function):
    """(gathers, params, dtype, *local shards) -> the params' full tensors (matrices in `dtype`: `gather_cast`).
    Backward: the full gradients to the reducer (which takes them in fp32), whose returned shard gradients (or
    None) flow on to the DTensor parameters in their own dtype."""

    @staticmethod
    def forward(ctx, book: Gathers, params: list, dtype: torch.dtype | None, *shards: torch.Tensor):
        ctx.book, ctx.params = book, params
        full = _gather_by_dtype([gather_cast(t, dtype) for t in shards], [p.shape for p in params])
        trim_host_memory()  # see device.trim_host_memory: else each block's gather grows the host heap
        book.track(full)
        return tuple(full)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.book.reducer is None:
            raise RuntimeError("a backward through a sharded model's gathers needs a reducer (fsdp.reducing)")
        shards = ctx.book.reducer.reduce_group(ctx.params, list(grads))
        trim_host_memory()  # the block's full gradient and the reduce's buffers
        return None, None, None, *shards


def _gather(model, params: list, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    full = Gather.apply(gathers(model), params, dtype, *(p.to_local() for p in params))
    return list(full)


def gather_block(model, block: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One block's parameters, full (names relative to the block), its matrices in `dtype` (the compute dtype:
    `gather_cast`; None: the masters'). Collective."""
    named = list(block.named_parameters())
    return dict(zip((n for n, _ in named), _gather(model, [p for _, p in named], dtype)))


def root_params(model) -> list[torch.Tensor]:
    """The root group's parameters (the embedding, final norm, lm_head; a tied one once), in a fixed order."""
    inner = {id(p) for b in blocks(model) for p in b.parameters()}
    return [p for p in model.parameters() if id(p) not in inner]


def gather_root(model, dtype: torch.dtype | None = None) -> dict[int, torch.Tensor]:
    """The root group's parameters, full, by the identity of the sharded parameter (tied ones share one
    gathered tensor), matrices in `dtype` unless the embedding is tied to the head: the forward casts it once
    per use, so its two gradients meet in fp32 (one bf16 gather would sum them in bf16). Collective."""
    params = root_params(model)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return dict(zip((id(p) for p in params), _gather(model, params, None if tied else dtype)))
