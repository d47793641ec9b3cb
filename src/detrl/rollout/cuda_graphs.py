"""The paged engine's decode step as CUDA graphs, in the shape of nano-vllm's model runner.

A decode step of the paged core launches a few hundred small kernels (28 layers x norms, gemms, rope, attention,
pool writes): on a GPU the host's launches, not the device, set its time. Here each step's rows are padded to a
power-of-two bucket and the step is one replay of a graph captured once per (bucket, read width) for the pool it
runs on: the step's inputs (tokens, positions, write slots, the rows' block tables) go into one static buffer in
one copy, the graph runs `paged.paged_forward` on it, and the core samples from the graph's logits as it does
from the eager forward's.

Padding rows read the zero block at position 0 and write the pool's sink block, which no row reads; with the
batch-invariant kernels a row's bits do not depend on how many rows share its step, so a padded, replayed step
gives the eager step's bits (tested on CPU with the batch-invariant ops, `capture=False`, and on a GPU). The read
width is the pool's `graph_width`: the Triton paged kernel reads the block tables in place (one width), the
gathering pools read a power-of-two bucket of the widest row's slots. Graphs hold the pool's tensors: they are
dropped when the pool is (`EngineCore.release`, between rollouts) and captured again on the next pool, lazily,
only for the buckets that steps reach.
"""

from __future__ import annotations

import torch

from detrl.models.forward import Weights
from detrl.models.ops import Ops
from detrl.rollout.paged import KVPool, paged_forward


def bucket(n: int) -> int:
    """The power of two >= n rows a step runs at."""
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    """`EngineCore.decode`: (pool, tokens, positions, write, table, width) -> (logits [B, V], route) for a
    decode step of B <= max_rows rows. capture=False runs the same padded step eagerly (CPU: the test of the
    padding; a GPU without graphs)."""

    def __init__(
        self,
        weights: Weights,
        ops: Ops,
        ctx_len: int,
        block_size: int,
        rope,
        max_rows: int,
        device,
        capture: bool = True,
    ):
        self.weights, self.ops, self.ctx_len, self.rope = weights, ops, ctx_len, rope
        self.device, self.capture, self.rows = torch.device(device), capture, bucket(max_rows)
        shape = (
            self.rows,
            3 + -(-ctx_len // block_size),
        )  # per row: token, position, write slot, block table
        self.inputs = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.host = torch.zeros(shape, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.last = torch.zeros(self.rows, dtype=torch.long, device=self.device)  # T = 1: index 0
        self.graphs: dict[tuple[int, int], tuple] = {}  # (bucket, width) -> (graph, its outputs)
        self.pool: KVPool | None = None
        self.mempool = None

    def clear(self) -> None:
        """Drop the graphs (and their memory): the pool they read is gone."""
        self.graphs.clear()
        self.pool = self.mempool = None

    def __call__(self, pool: KVPool, tokens, positions, write, table, width: int):
        b = tokens.shape[0]
        if b > self.rows:
            raise ValueError(f"a decode step of {b} rows; the graphs hold at most {self.rows}")
        if pool is not self.pool:
            self.clear()
            self.pool = pool
        bb, wb = bucket(b), pool.graph_width(width)
        self._fill(pool, b, bb, tokens, positions, write, table)
        if not self.capture:
            logits, route = self._forward(pool, bb, wb)
        else:
            if (bb, wb) not in self.graphs:
                self.graphs[bb, wb] = self._capture(pool, bb, wb)
            graph, (logits, route) = self.graphs[bb, wb]
            graph.replay()
        return logits[:b], None if route is None else route[:b]

    def _fill(self, pool: KVPool, b: int, bb: int, tokens, positions, write, table) -> None:
        """The step's host tensors into the static input buffer, padding rows after them, in one copy."""
        host = self.host[:bb]
        host[:b, 0], host[:b, 1], host[:b, 2] = tokens[:, 0], positions[:, 0], write[:, 0]
        host[:b, 3:] = table
        if bb > b:  # token 0 at position 0, written to the sink, reading the zero block
            host[b:, :2] = 0
            host[b:, 2] = pool.sink_slot
            host[b:, 3:] = pool.blocks
        self.inputs[:bb].copy_(host, non_blocking=True)

    def _forward(self, pool: KVPool, bb: int, wb: int):
        x = self.inputs[:bb]
        return paged_forward(
            self.weights, x[:, 0:1], x[:, 1:2], self.ops, self.ctx_len, self.rope, pool, x[:, 2:3], None,
            x[:, 3:], self.last[:bb], width=wb,
        )  # fmt: skip

    def _capture(self, pool: KVPool, bb: int, wb: int) -> tuple:
        """Warm up on a side stream (Triton's compiles, the allocator), then capture one step. Both write the
        step's keys and values, the same bits the replay writes after."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(pool, bb, wb)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(pool, bb, wb)
        return graph, out
