"""The paged engine's decode step as CUDA graphs, in the shape of nano-vllm's model runner.

A decode step of the paged core launches a few hundred small kernels (28 layers x norms, gemms, rope, attention,
pool writes): on a GPU the host's launches, not the device, set its time. Here each step's rows are padded to a
power-of-two bucket and the step is one replay of a graph captured once per (bucket, read width) for the pool it
runs on: the step's inputs (tokens, positions, write slots, seeds, the rows' block tables) go into one static
buffer in one copy, and the graph runs `paged.paged_forward` on it. When every row samples seeded with one
temperature and top_p (determinism on: the trainer's requests) the graph samples too, with the eager sampler's ops
(`forward.log_probs`, `sampling.hashed_gumbel`, `sampling.sample`: the same kernels, so the same bits as a token
the core samples eagerly after a prefill); otherwise the core samples from the graph's logits.

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

from detrl.models.forward import Weights, log_probs
from detrl.models.ops import Ops
from detrl.rollout.paged import KVPool, paged_forward
from detrl.rollout.sampling import hashed_gumbel, sample

INPUTS = 4  # the static buffer's columns before a row's block table: token, position, write slot, seed


def bucket(n: int) -> int:
    """The power of two >= n rows a step runs at."""
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    """`EngineCore.decode` for decode steps of B <= max_rows rows (`__call__`). capture=False runs the same padded
    step eagerly (CPU: the test of the padding and the in-step draw; a GPU without graphs)."""

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
        shape = (self.rows, INPUTS + -(-ctx_len // block_size))  # per row: the INPUTS, then its block table
        self.inputs = torch.zeros(shape, dtype=torch.long, device=self.device)
        # two pinned host buffers, used in turn: with the engine's overlap (`cuda_overlap`) a step is filled
        # while the previous step's copy may still be queued; the one before it has run by then
        pin = self.device.type == "cuda"
        self.hosts = [torch.zeros(shape, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.calls = 0
        self.last = torch.zeros(self.rows, dtype=torch.long, device=self.device)  # T = 1: index 0
        self.graphs: dict[tuple, tuple] = {}  # (bucket, width, draw params) -> (graph, its outputs)
        self.pool: KVPool | None = None
        self.mempool = None

    def clear(self) -> None:
        """Drop the graphs (and their memory): the pool they read is gone."""
        self.graphs.clear()
        self.pool = self.mempool = None

    def __call__(self, pool: KVPool, tokens, positions, write, table, width: int, draw=None):
        """-> (logits [B, V], route [B, layers, k] or None, (tokens [B], logprobs [B]) when `draw`
        (temperature, top_p, seeds) was given, else None). `tokens` [B, 1] on the host, or on the device (the
        previous step's draw, which the host has not read yet: `cuda_overlap`)."""
        b = tokens.shape[0]
        if b > self.rows:
            raise ValueError(f"a decode step of {b} rows; the graphs hold at most {self.rows}")
        if pool is not self.pool:
            self.clear()
            self.pool = pool
        key = (bucket(b), pool.graph_width(width), None if draw is None else draw[:2])
        self._fill(pool, b, key[0], tokens, positions, write, table, None if draw is None else draw[2])
        if not self.capture:
            logits, route, drawn = self._step(pool, *key)
        else:
            if key not in self.graphs:
                self.graphs[key] = self._capture(pool, key)
            graph, (logits, route, drawn) = self.graphs[key]
            graph.replay()
        return (
            logits[:b],
            None if route is None else route[:b],
            None if drawn is None else (drawn[0][:b], drawn[1][:b]),
        )

    def _fill(self, pool: KVPool, b: int, bb: int, tokens, positions, write, table, seeds) -> None:
        """The step's host tensors into the static input buffer, padding rows after them, in one copy."""
        self.calls += 1
        host, on_host = self.hosts[self.calls % 2][:bb], tokens.device == self.hosts[0].device
        host[:b, 0], host[:b, 1], host[:b, 2] = tokens[:, 0] if on_host else 0, positions[:, 0], write[:, 0]
        host[:b, 3] = 0 if seeds is None else torch.tensor(seeds)
        host[:b, INPUTS:] = table
        if bb > b:  # token 0 at position 0, seed 0, written to the sink, reading the zero block
            host[b:, :INPUTS] = 0
            host[b:, 2] = pool.sink_slot
            host[b:, INPUTS:] = pool.blocks
        self.inputs[:bb].copy_(host, non_blocking=True)
        if not on_host:  # queued after the copy, before the replay: the device's tokens, never read here
            self.inputs[:b, 0].copy_(tokens[:, 0])

    def _step(self, pool: KVPool, bb: int, wb: int, draw: tuple[float, float] | None):
        """The forward on the static inputs' first bb rows; with `draw` (temperature, top_p) also the seeded
        sample of each row's next token (at its position + 1) and its logprob, as `EngineCore._sample` draws it."""
        x = self.inputs[:bb]
        logits, route = paged_forward(
            self.weights, x[:, 0:1], x[:, 1:2], self.ops, self.ctx_len, self.rope, pool, x[:, 2:3], None,
            x[:, INPUTS:], self.last[:bb], width=wb,
        )  # fmt: skip
        if draw is None:
            return logits, route, None
        logp = log_probs(logits, draw[0])  # [bb, V]
        tok = sample(logp, hashed_gumbel(x[:, 3], x[:, 1] + 1, logp.shape[-1]), draw[1])
        return logits, route, (tok, logp.gather(-1, tok[:, None]).squeeze(-1))

    def _capture(self, pool: KVPool, key: tuple) -> tuple:
        """Warm up on a side stream (Triton's compiles, the allocator), then capture one step. Both write the
        step's keys and values, the same bits the replay writes after."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(pool, *key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._step(pool, *key)
        return graph, out
