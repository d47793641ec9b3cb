"""FSDP2 over detrl's models as torchtitan applies it: `fully_shard` on each decoder block, then on the root.

Each block is its own parameter group (its own all-gather); the root's group holds what is left (embedding,
final norm, lm_head). Mixed precision (`policy`): on GPUs under `off` the blocks are gathered in the compute dtype
(bf16) and gradients reduced in fp32; on CPU, and under `on` everywhere, gathers stay fp32 so the bits are one
process's. The weight sync and `fp/params` read the parameters one at a time (`full_items`): at most one full
tensor exists at once, never the full model.

No import of detrl here (distributed.py re-exports these): the mesh is torch's, over the default group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

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


def shard(model: torch.nn.Module, compute: torch.dtype | None = None, ordered: bool = True) -> None:
    """`fully_shard` on each block, then the root (in place): torchtitan's parallelize order. detrl's functional
    forward runs no module hooks: `unshard` / `reshard` around it are explicit; the modules' own forward (layer
    digests) gathers and frees one block at a time through FSDP2's hooks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = next(model.parameters())
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype(p.device.type, compute, ordered, p.dtype), reduce_dtype=torch.float32
    )
    m = mesh(p.device)
    for block in blocks(model):
        fully_shard(block, mesh=m, mp_policy=mp)
    fully_shard(model, mesh=m, mp_policy=mp)


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
    """Every group's full parameters all-gathered (each group one all-gather). Collective."""
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


def full_params(model) -> Iterator[torch.Tensor]:
    """The trainable parameters in sorted name order (the drift sketch's), full, gathered one at a time when
    sharded. Collective: every rank must consume the whole iterator."""
    from torch.distributed.tensor import DTensor

    for _, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        yield p.full_tensor() if isinstance(p, DTensor) else p


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole state dict (DTensors all-gathered; the same names and bits as unsharded): checkpoints' final
    save only. The per-step sync uses `full_items`."""
    return dict(full_items(model)) if is_sharded(model) else model.state_dict()
