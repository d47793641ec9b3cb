"""Rollout engines by (backend, device type): where a run's engine is built from its config. Each builder takes
(model, determinism, runtime, sampling, seed, rollout config)."""

from __future__ import annotations

from collections.abc import Callable

from detrl.rollout.base import Engine
from detrl.rollout.paged import PoolSpec

ENGINES: dict[tuple[str, str], Callable[..., Engine]] = {}


def register(backend: str, device: str):
    def add(build: Callable[..., Engine]) -> Callable[..., Engine]:
        ENGINES[(backend, device)] = build
        return build

    return add


def _shared(det, seed: int, rollout) -> dict:
    """The keyword arguments every engine takes from the run: its seed, batch cap and routing."""
    return dict(seed=seed, max_batch_size=rollout.max_batch_size, fixed_routing=det.fixed_routing)


@register("embedded", "cpu")
def _cpu(model, det, rt, sampling, seed: int, rollout) -> Engine:
    from detrl.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(
        model, rt.ops, rt.ctx_len, sampling, num_workers=rollout.num_workers, scheduler=rollout.scheduler,
        pool=PoolSpec.from_config(rollout), **_shared(det, seed, rollout),
    )  # fmt: skip


@register("embedded", "cuda")
def _cuda(model, det, rt, sampling, seed: int, rollout) -> Engine:
    on_device = dict(_shared(det, seed, rollout), device=rt.device, dtype=rt.dtype)
    if rollout.scheduler == "continuous":  # the paged scheduler core on the device
        from detrl.rollout.cuda_paged import CudaPagedEngine

        return CudaPagedEngine(
            model, rt.ops, rt.ctx_len, sampling, pool=PoolSpec.from_config(rollout), **on_device
        )
    from detrl.rollout.cuda import CudaEngine  # static: the bucketed engine with CUDA graphs

    return CudaEngine(model, rt.ops, rt.ctx_len, sampling, compile=rt.compile, **on_device)


def build_engine(backend: str, device: str, *args, **kwargs) -> Engine:
    """The engine registered for (backend, device); one line naming the valid pairs otherwise."""
    if (backend, device) not in ENGINES:
        pairs = ", ".join(f"{b}/{d}" for b, d in ENGINES)
        raise ValueError(
            f"no rollout engine for backend={backend!r} on device={device!r}; registered: {pairs}"
        )
    return ENGINES[(backend, device)](*args, **kwargs)
