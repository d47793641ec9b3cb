"""One engine core: a scheduler with waiting / running queues over a paged KV pool (continuous batching).

nano-vllm's loop, schedule -> run -> postprocess, one `step` at a time: waiting sequences are admitted while
the running set has room and the pool has blocks (their cached prefix blocks taken by reference); every step
runs one prefill call over the sequences still prefilling (at most `chunk` tokens each: a long prompt does not
stall decoding) and one decode call over the rest; a sequence leaves the moment it samples a stop token or
reaches its limit. A sequence that needs a block when none is free preempts the newest running one (its blocks
released, recomputed later from its tokens, as vLLM's recompute preemption). A sequence whose next prefix
block another sequence is computing right now waits for it (the samples of a group share the prompt's blocks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from detrl.models.forward import Weights, log_probs, rope_tables
from detrl.models.ops import Ops
from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.paged import BlockManager, KVPool, SeqBlocks, paged_forward, pool_for
from detrl.rollout.sampling import hashed_gumbel, noise_chunk, sample, stream_gumbel


@dataclass(eq=False)  # compared by identity
class Sequence:
    key: object  # the caller's handle, returned with the result
    request: Request
    params: SamplingParams
    tokens: list[int]  # prompt + prefix + sampled so far
    context: int  # len(prompt + prefix): sampled tokens start here
    limit: int  # new tokens allowed in this call
    room: int  # new tokens left before "length"
    computed: int = 0  # tokens whose KV is in the pool
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    chain: list[int] = field(default_factory=list)  # chain hashes of the full blocks before the last token
    logprobs: list[float] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)
    noise: tuple[int, int, int] | None = None  # SeededNoise: (buffer row, first position, positions held)

    @property
    def sampled(self) -> list[int]:
        return self.tokens[self.context :]


class SeededNoise:
    """The hashed Gumbel noise of seeded running sequences, `chunk` positions at a time: the rows that ran out
    are hashed together for their next positions ([R, C, V] in one call, not one [R, V] call per step) into a
    [max_running, C, V] buffer, read a row and position at a time. The noise is a function of (seed, position,
    vocab id) alone, so the chunking changes no bit. `chunk` is `sampling.noise_chunk`'s, as the static engine's:
    1 (no buffer) for a real vocabulary. It is hashed on `device`, where the logits are: integer hashing is exact
    anywhere, and a [rows, V] float64 tensor per step is too much to hash on the host and copy (Qwen3's vocab)."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str = "cpu"):
        self.vocab, self.chunk, self.rows = vocab, noise_chunk(rows, vocab), rows
        self.device = torch.device(device)
        self.free = list(range(rows - 1, -1, -1))  # buffer rows not held by a sequence
        self.buf: torch.Tensor | None = None

    def take(self, rows: list[Sequence]) -> torch.Tensor:
        """The noise [G, V] of each row's next token (position len(tokens))."""
        pos = [len(s.tokens) for s in rows]
        dev = self.device
        if self.chunk == 1:
            seeds = torch.tensor([s.request.seed for s in rows], device=dev)
            return hashed_gumbel(seeds, torch.tensor(pos, device=dev), self.vocab)
        if self.buf is None:
            self.buf = torch.empty(len(self.free), self.chunk, self.vocab, dtype=torch.float64, device=dev)
        out = [s for s, p in zip(rows, pos) if s.noise is None or not 0 <= p - s.noise[1] < s.noise[2]]
        if out:
            steps = min(
                self.chunk, max(s.limit - (len(s.tokens) - s.context) for s in out)
            )  # positions still to sample
            for s in out:
                s.noise = (self.free.pop() if s.noise is None else s.noise[0], len(s.tokens), steps)
            start = torch.tensor([s.noise[1] for s in out], device=dev)
            seeds = torch.tensor([s.request.seed for s in out], device=dev)
            noise = hashed_gumbel(seeds, start[:, None] + torch.arange(steps, device=dev), self.vocab)
            self.buf[torch.tensor([s.noise[0] for s in out], device=dev), :steps] = noise
        at = torch.tensor([s.noise[0] * self.chunk + p - s.noise[1] for s, p in zip(rows, pos)], device=dev)
        return self.buf.view(-1, self.vocab).index_select(0, at)

    def clear(self) -> None:
        """Free the buffer (no sequence holds a row): `release`, while the trainer updates."""
        assert len(self.free) == self.rows, "noise buffer rows still held"
        self.buf = None

    def drop(self, s: Sequence) -> None:
        """The sequence left the running set: its buffer row is free."""
        if s.noise is not None:
            self.free.append(s.noise[0])
            s.noise = None


def _seeded_draw(rows: list[Sequence]) -> tuple[float, float, list[int]] | None:
    """(temperature, top_p, seeds) when every row samples seeded with one temperature and top_p: a draw a
    replayed decode step can make itself (the hashed noise is a function of seed, position and token id)."""
    params = (rows[0].params.temperature, rows[0].params.top_p)
    if any(s.request.seed is None or (s.params.temperature, s.params.top_p) != params for s in rows):
        return None
    return *params, [s.request.seed for s in rows]


@dataclass
class Finished:
    key: object
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: np.ndarray | None


class EngineCore:
    """The scheduler, the block manager and the model runner of one replica (one process, one pool)."""

    def __init__(
        self,
        weights: Weights,
        ops: Ops,
        ctx_len: int,
        blocks: int,
        block_size: int,
        chunk: int,
        max_running: int,
        generator: torch.Generator | None = None,
        prefix_cache: bool = True,
        device: torch.device | str = "cpu",
        pool_type: type[KVPool] | None = None,
    ):
        need = -(-ctx_len // block_size)
        if blocks < need:
            raise ValueError(
                f"kv pool of {blocks} blocks of {block_size}: one sequence of ctx_len={ctx_len} needs {need}"
            )
        self.weights, self.ops, self.ctx_len = weights, ops, ctx_len
        self.block_size, self.chunk, self.max_running, self.num_blocks = (
            block_size,
            chunk,
            max_running,
            blocks,
        )
        self.device = torch.device(device)  # where the pool and the forward live
        self.pool_type = pool_type or pool_for(ops)  # None: the gathering pool the op set's attention reads
        self.rope = rope_tables(weights.config, ctx_len, self.device, weights.embed.dtype)
        self.seeded = SeededNoise(max_running, weights.config.vocab_size, self.device)
        # the stream of unseeded draws, on the core's device (where the noise is made)
        self.generator = generator or torch.Generator(self.device).manual_seed(0)
        self.pool: KVPool | None = None
        self.manager = BlockManager(blocks, block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache = prefix_cache  # False: every sequence prefills its whole context (cold)
        self.steps, self.computed_tokens = 0, 0  # steps run, tokens forwarded (prefill + decode)
        self.hit_blocks, self.preemptions = 0, 0  # blocks taken from the prefix cache; sequences preempted
        # what runs a decode step instead of the eager forward: (pool, tokens, positions, write, table [host
        # tensors], width, draw) -> (logits, route, drawn), e.g. `cuda_graphs.DecodeGraphs` (the CUDA engine's
        # graphs); drawn: (tokens, logprobs) when it sampled the `_seeded_draw` itself, else None
        self.decode = None

    def add(self, key, request: Request, params: SamplingParams) -> None:
        ctx = list(request.prompt_ids + request.prefix)
        room = params.max_new_tokens - len(request.prefix)
        limit = room if request.max_new_tokens is None else min(room, request.max_new_tokens)
        self.waiting.append(Sequence(key, request, params, ctx, len(ctx), limit, room))

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def release(self) -> None:
        """Free the pool and the noise buffer, forget the prefix cache (between rollouts: the weights are about
        to change)."""
        assert self.idle(), "release with sequences in flight"
        self.pool = None
        if self.decode is not None:
            self.decode.clear()  # its graphs read the pool just freed
        self.seeded.clear()
        self.manager = BlockManager(self.num_blocks, self.block_size)
        self.computed_tokens = self.hit_blocks = self.preemptions = 0  # stats since the last release

    def stats(self) -> dict[str, int]:
        """KV bytes held at the peak, the pool's bytes, prefix-cache hits, tokens forwarded."""
        block = self.pool.block_bytes if self.pool else 0
        return {
            "kv_bytes_peak": self.manager.used_peak * block,
            "kv_pool_bytes": self.num_blocks * block,
            "hit_blocks": self.hit_blocks,
            "computed_tokens": self.computed_tokens,
            "preemptions": self.preemptions,
        }

    def abort(self) -> list[Finished]:
        """Every sequence out now, as "abort" with what it sampled (unstarted ones with nothing)."""
        out = [self._finish(s, "abort") for s in [*self.running, *self.waiting]]
        self.running, self.waiting = [], deque()
        return out

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit, run one prefill call and one decode call, and return the sequences that finished."""
        if self.pool is None:
            self.pool = self.pool_type(
                self.weights.config,
                self.num_blocks,
                self.block_size,
                self.weights.embed.dtype,
                self.ctx_len,
                self.device,
            )
        done = [self._finish(s, "length" if s.room <= 0 else "abort") for s in self._admit() if s.limit <= 0]
        self.running = [s for s in self.running if s.limit > 0]
        prefill = [s for s in self.running if len(s.tokens) - s.computed > 1]
        decode = [s for s in self.running if len(s.tokens) - s.computed == 1]
        for batch, width, decoding in ((prefill, self.chunk, False), (decode, 1, True)):
            batch = self._reserve(batch, width)
            if batch:
                done += self._run(batch, width, decoding)
        self.steps += 1
        return done

    def _admit(self) -> list[Sequence]:
        """Waiting sequences into the running set, in arrival order, while there is room and blocks."""
        admitted, deferred, bs = [], deque(), self.block_size
        inflight = {
            h for s in self.running for h in s.chain[s.computed // bs :]
        }  # prefix blocks being computed
        while self.waiting and len(self.running) < self.max_running:
            s = self.waiting.popleft()
            s.chain = self.manager.chain_of(s.tokens[: len(s.tokens) - 1])
            cached = self.manager.cached(s.chain, s.tokens) if self.prefix_cache else []
            if self.prefix_cache and len(cached) < len(s.chain) and s.chain[len(cached)] in inflight:
                deferred.append(s)  # its next prefix block is being computed: take it by reference later
                continue
            need = -(-len(s.tokens) // bs) - len(cached)
            if len(self.manager.free) - sum(self.manager.blocks[b].ref == 0 for b in cached) < need:
                self.waiting.appendleft(s)
                break
            for bid in cached:
                self.manager.take(bid)
            self.hit_blocks += len(cached)
            s.blocks = SeqBlocks(list(cached), s.chain[: len(cached)])
            s.computed = len(cached) * bs
            self.running.append(s)
            admitted.append(s)
            inflight.update(s.chain[len(cached) :])
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _reserve(self, batch: list[Sequence], width: int) -> list[Sequence]:
        """Blocks for each row's next `width` tokens; when the pool is out, preempt the newest running."""
        preempted = {id(s) for s in batch} - {id(s) for s in self.running}  # out since the batch was made
        for s in batch:
            end = min(len(s.tokens), s.computed + width)
            while id(s) not in preempted and len(s.blocks.table) * self.block_size < end:
                if self.manager.free:
                    s.blocks.table.append(self.manager.allocate())
                else:
                    preempted.add(id(self.running[-1]))
                    self._preempt(self.running[-1])
        return [s for s in batch if id(s) not in preempted]

    def _preempt(self, s: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(s)
        self.manager.release(s.blocks.table)
        self.seeded.drop(s)
        s.blocks, s.computed = SeqBlocks(), 0
        self.waiting.appendleft(s)

    def _run(self, batch: list[Sequence], width: int, decoding: bool) -> list[Finished]:
        """One forward over the rows' next <= width tokens; rows whose context is then computed sample.
        `decoding`: every row has its last token left (a decode step; a prefill chunk of 1 is not one)."""
        pool = self.pool
        n = [min(width, len(s.tokens) - s.computed) for s in batch]
        t = max(n)
        rows = [s.tokens[s.computed : s.computed + k] + [0] * (t - k) for s, k in zip(batch, n)]
        tokens = torch.tensor(rows, dtype=torch.long)  # right-padded [B, T]
        positions, valid, table, write, read = self._inputs(batch, n)
        drawn = None  # (tokens, logprobs) when the replayed step sampled too
        if decoding and self.decode is not None:  # a decode step, replayed (CUDA graphs)
            logits, route, drawn = self.decode(
                pool, tokens, positions, write, table, read, _seeded_draw(batch)
            )
        else:
            dev = self.device
            logits, route = paged_forward(
                self.weights, tokens.to(dev), positions.to(dev), self.ops, self.ctx_len, self.rope, pool,
                write.to(dev), None if valid is None else valid.to(dev), table.to(dev),
                (torch.tensor(n) - 1).to(dev), fresh=width > 1 and all(s.computed == 0 for s in batch), width=read,
            )  # fmt: skip
        self.computed_tokens += sum(n)
        for i, s in enumerate(batch):
            s.computed += n[i]
            self._publish(s)
        if decoding and self.decode is not None:
            return self._decoded(batch, logits, route, drawn)
        ready = [i for i, s in enumerate(batch) if s.computed == len(s.tokens)]
        if len(ready) == len(batch):  # every row samples (a decode step): no row gathers
            return self._sample(batch, logits, route)
        return self._sample([batch[i] for i in ready], logits[ready], None if route is None else route[ready])

    def _inputs(self, batch: list[Sequence], n: list[int]):
        """The host inputs of a step taking each row's next n[i] tokens from position `computed`: positions [B, T]
        (T = max(n); padding at position 0, never written), valid [B, T] (None: every slot is a token), block
        tables [B, blocks], write slots [B, T] and the read width W (no sync)."""
        t = max(n)
        positions = torch.tensor([s.computed for s in batch])[:, None] + torch.arange(t)
        valid = None
        if min(n) < t:
            valid = torch.arange(t)[None, :] < torch.tensor(n)[:, None]
            positions = positions.masked_fill(~valid, 0)
        table = self.pool.tables([s.blocks for s in batch])
        return positions, valid, table, self.pool.token_slots(table, positions), self._read_width(batch)

    def _read_width(self, batch: list[Sequence]) -> int:
        """W: the slots the widest row's blocks hold, at most ctx_len (counted on the host)."""
        return min(self.ctx_len, max(len(s.blocks.table) for s in batch) * self.block_size)

    def _decoded(self, batch: list[Sequence], logits, route, drawn) -> list[Finished]:
        """A replayed decode step's rows: their tokens (drawn in the step, or sampled from its logits) appended."""
        if drawn is None:
            return self._sample(batch, logits, route)
        return self._leave(self._take(batch, *drawn, route))

    def _publish(self, s: Sequence) -> None:
        """Cache the sequence's blocks that are now full and computed (shared by later sequences)."""
        bs, h = self.block_size, s.blocks.hashes
        for j in range(len(h), s.computed // bs):
            h.append(
                self.manager.publish(
                    s.blocks.table[j], h[-1] if h else None, tuple(s.tokens[j * bs : (j + 1) * bs])
                )
            )

    def _sample(
        self, rows: list[Sequence], logits: torch.Tensor, route: torch.Tensor | None
    ) -> list[Finished]:
        """The next token of each row (rows grouped by their sampling params), and the rows that finish."""
        leaving: list[tuple[Sequence, str]] = []
        groups: dict[tuple[float, float], list[int]] = {}
        for i, s in enumerate(rows):
            groups.setdefault((s.params.temperature, s.params.top_p), []).append(i)
        for (temperature, top_p), idx in groups.items():
            whole = len(idx) == len(rows)  # one group (the usual case): no row gathers
            group = rows if whole else [rows[i] for i in idx]
            tok, lp = self._draw(group, logits if whole else logits[idx], temperature, top_p)
            leaving += self._take(group, tok, lp, route if route is None or whole else route[idx])
        return self._leave(leaving)

    def _draw(self, rows: list[Sequence], logits, temperature: float, top_p: float):
        """The rows' next tokens [G] from logits [G, V] and their logprobs [G], on the core's device."""
        logp = log_probs(logits, temperature)
        tok = sample(logp, self._noise(rows, logp.shape[-1]), top_p)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def _take(self, rows: list[Sequence], tok, lp, route) -> list[tuple[Sequence, str]]:
        """The rows' sampled tokens tok [G] and logprobs lp [G] (and expert ids route [G, layers, k]) appended."""
        ids = None if route is None else route.to(torch.int16).cpu().numpy()
        return self._append(rows, tok.tolist(), lp.tolist(), ids)

    def _leave(self, leaving: list[tuple[Sequence, str]]) -> list[Finished]:
        """The rows that finished out of the running set."""
        if leaving:
            gone = {id(s) for s, _ in leaving}
            self.running = [s for s in self.running if id(s) not in gone]
        return [self._finish(s, reason) for s, reason in leaving]

    def _append(self, rows: list[Sequence], tokens: list[int], logprobs: list[float], experts) -> list:
        """Each row's sampled token (and its logprob, expert ids); -> (row, finish reason) of the rows it ends."""
        leaving = []
        for j, (s, t) in enumerate(zip(rows, tokens)):
            s.tokens.append(t)
            s.logprobs.append(logprobs[j])
            if experts is not None:
                s.experts.append(experts[j])
            n = len(s.tokens) - s.context
            stop = t in s.params.stop_token_ids
            reason = "stop" if stop else "length" if n >= s.room else "abort" if n >= s.limit else None
            if reason is not None:
                leaving.append((s, reason))
        return leaving

    def _noise(self, rows: list[Sequence], vocab: int) -> torch.Tensor:
        """Gumbel noise [G, V] on the core's device: seeded rows hash (seed, position, vocab id); the others draw from
        the stream (`generator`, on its device)."""
        seeded = [i for i, s in enumerate(rows) if s.request.seed is not None]
        if len(seeded) == len(rows):
            return self.seeded.take(rows)
        if not seeded:  # the stream's draws as they come (no buffer, no row index to copy to the device)
            return stream_gumbel(self.generator, (len(rows),), vocab)
        out = torch.empty(len(rows), vocab, dtype=torch.float64, device=self.device)  # both kinds of row
        out[seeded] = self.seeded.take([rows[i] for i in seeded])
        rest = [i for i, s in enumerate(rows) if s.request.seed is None]
        out[rest] = stream_gumbel(self.generator, (len(rest),), vocab)
        return out

    def _finish(self, s: Sequence, reason: str) -> Finished:
        self.manager.release(s.blocks.table)
        self.seeded.drop(s)
        s.blocks = SeqBlocks()
        experts = np.stack(s.experts) if s.experts else None
        return Finished(s.key, list(s.sampled), list(s.logprobs), reason, experts)
