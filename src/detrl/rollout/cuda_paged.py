"""The embedded engine on a device, on the paged scheduler core: one in-process `scheduler.EngineCore`.

The scheduling and bookkeeping (waiting / running queues, chunked prefill, preemption, hashed prefix blocks,
sampling) are the CPU engine's code; what is device-specific is small: the weights and the KV pool's tensors
live on `device`, and under the invariant op set (determinism on, `cuda_invariant`) attention reads the pool
through the block tables with the Triton paged kernel (`models.triton_paged`, bitwise the trainer's contiguous
kernel); otherwise (determinism off on CUDA) the keys are gathered and the default op set's attention runs over
them (torch SDPA under the mask). On CPU (`device="cpu"`) it runs the given op set over gathered keys, exactly as
an `EmbeddedEngine` worker does: the bits are the worker's (the CPU test of this code path).

The pool is sized from the device's free memory and the cap (`paged.pool_blocks`), freed at `update_weights`
and rebuilt at the next call; the weights are updated in place. One replica: fixed and dynamic routing both add
every request to the core (results in request order under fixed routing, else in completion order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from detrl.models.forward import engine_copy
from detrl.models.ops import Ops, moe_dispatch, sdpa_attention
from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.batching import check_fits, prompt_groups
from detrl.rollout.cuda_graphs import DecodeGraphs
from detrl.rollout.cuda_overlap import OverlapCore
from detrl.rollout.paged import KVPool, LivePool, Plan, PoolSpec, kv_token_bytes, pool_for
from detrl.rollout.scheduler import EngineCore
from detrl.rollout.weight_views import copy_into

INVARIANT_OPS = "cuda_invariant"  # the op set whose attention the paged kernel replaces
DEVICE_POOL = PoolSpec(block_size=16, prefill_chunk=512, kv_pool_max_tokens=65536)  # when none is given


class KernelPool(KVPool):
    """A pool whose attention reads it in place: the mask carries the block tables and positions, and
    `write_read` returns the layer's whole K and V pool (no gather)."""

    def mask(self, positions: torch.Tensor, table: torch.Tensor, plan: Plan):
        from detrl.models.triton_paged import PagedMeta

        return PagedMeta(table, positions, self.size, self.block_size, self.ctx_len)

    def read_width(self, width: int, decode: bool) -> int:
        return width  # unread: the kernel walks the block tables

    def graph_width(self, width: int) -> int:
        return self.ctx_len  # one graph per bucket: the kernel's reads follow the positions, on the device

    pads = False  # the kernel reads the pool in place, a cold prefill too

    def write_read(self, layer: int, k, v, plan: Plan):
        self.write(layer, k, v, plan)
        return self.k[layer], self.v[layer]


def device_ops(ops: Ops) -> tuple[Ops, type]:
    """The engine's op set on a device and its pool type (weights pre-cast: no dtype, no recomputation): under
    the invariant set attention reads the pool in place (`KernelPool`, the Triton paged kernel), otherwise the
    keys of the rows' blocks are gathered (`LivePool`) and torch SDPA runs under the mask. The preflight checks
    this same path."""
    invariant = ops.name == INVARIANT_OPS
    attention = _paged_attention if invariant else sdpa_attention
    return dataclasses.replace(ops, dtype=None, checkpoint=False, attention=attention), (
        KernelPool if invariant else LivePool
    )


class CudaPagedEngine:
    """Holds its own copy of the policy weights on `device` (synced in place by `update_weights`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        ops: Ops,
        ctx_len: int,
        params: SamplingParams,
        seed: int,
        max_batch_size: int = 64,
        fixed_routing: bool = True,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        pool: PoolSpec = DEVICE_POOL,
        graphs: bool = True,
        overlap: bool = True,
    ):
        self.device, self.ctx_len, self.params = torch.device(device), ctx_len, params
        self.max_batch_size, self.fixed_routing = max_batch_size, fixed_routing
        self.config = model.config
        on_cpu = self.device.type == "cpu"
        if on_cpu:  # the CPU worker's setup: the op set as given, weights fused in its compute dtype
            self.ops, pool_type, wdtype = ops, pool_for(ops), ops.dtype
        else:  # as CudaEngine: the weights cast once, the op set's attention per determinism
            (self.ops, pool_type), wdtype = device_ops(ops), dtype
        # (an FSDP2-sharded model: empty, filled by the caller's streaming weight sync)
        self.weights = engine_copy(model, wdtype, self.device)
        # an explicit size is taken as given; an automatic one on CUDA: within half the free memory
        free = None
        if not pool.kv_pool_tokens and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        token_bytes = kv_token_bytes(self.config, self.weights.embed.dtype.itemsize)
        core = OverlapCore if overlap else EngineCore  # the host one decode step ahead of the device
        self.core = core(
            self.weights, self.ops, ctx_len, pool.blocks(free, token_bytes, ctx_len, max_batch_size),
            pool.block_size, pool.prefill_chunk, max_batch_size, torch.Generator(self.device), device=self.device,
            pool_type=pool_type,
        )  # fmt: skip
        # decode steps as CUDA graphs, unless the MoE dispatch syncs the host (its per-expert loop)
        moe_syncs = getattr(self.config, "num_experts", None) and self.ops.moe is moe_dispatch
        if graphs and self.device.type == "cuda" and not moe_syncs:
            self.core.decode = DecodeGraphs(
                self.weights, self.ops, ctx_len, pool.block_size, self.core.rope, max_batch_size, self.device
            )
        self.generator = torch.Generator().manual_seed(seed)  # the engine's stream (requests without a seed)
        self.batch_log: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._call = 0

    def stat(self, key: str) -> int:
        """A core statistic, e.g. kv_bytes_peak, kv_pool_bytes, hit_blocks."""
        return self.core.stats().get(key, 0)

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """A state dict or (name, tensor) pairs, copied into the engine's weights in place; the KV pool (and its
        prefix cache) is released, rebuilt at the next call."""
        copy_into(self.weights, weights.items() if isinstance(weights, dict) else weights)
        self.core.release()

    def abort(self) -> None:
        """A single in-process call runs to its end; `stop_when` cuts it between steps."""

    def close(self) -> None:
        if self.core.idle():
            self.core.release()

    def generate(
        self, requests: list[Request], params: SamplingParams | None = None, stop_when=None
    ) -> list[Result]:
        """As EmbeddedEngine.generate with one worker: fixed routing returns results in request order, else in
        completion order; `stop_when(results)` (dynamic routing) cuts running and queued sequences ("abort")."""
        self.batch_log = []
        if not requests:
            return []
        if self.fixed_routing and stop_when is not None:
            raise ValueError("stop_when needs dynamic routing; with fixed routing cut by token budget")
        params = params or self.params
        check_fits(requests, params, self.ctx_len)
        self._call += 1
        stream_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        self.core.generator.manual_seed(stream_seed % 2**63)  # worker 0's stream, as the embedded engine's
        for g in prompt_groups(list(enumerate(requests)), self.max_batch_size):
            for i, r in g:
                self.core.add((self._call, i), r, params)
        done = self._drain(requests, stop_when)
        if self.fixed_routing:
            by_uid = {r.uid: r for r in done}
            return [by_uid[r.uid] for r in requests]
        return done

    @torch.no_grad()
    def _drain(self, requests: list[Request], stop_when) -> list[Result]:
        done: list[Result] = []
        while not self.core.idle():
            cut = stop_when is not None and bool(done) and stop_when(done)
            finished = self.core.abort() if cut else self.core.step()
            results = [Result(requests[f.key[1]], f.tokens, f.logprobs, f.finish_reason, f.routed_experts)
                       for f in finished]  # fmt: skip
            if results:
                self.batch_log.append((0, tuple(r.uid for r in results)))
            done += results
        return done


def _paged_attention(q, k_pool, v_pool, meta, scale):
    from detrl.models.triton_paged import paged_attention

    return paged_attention(q, k_pool, v_pool, meta, scale)
