"""Paged KV: one pool of fixed-size blocks, a block table per sequence, hashed full blocks shared by reference.

As nano-vllm's block manager: a full block is keyed by a chain hash of its tokens and every token before it (a
token's keys and values depend on those only, for fixed weights), so the n samples of a prompt and a partial
rollout's continuation find the blocks already computed and take a reference instead of recomputing them. A
block whose count drops to 0 goes back to the free list but keeps its hash until it is handed out again.
Attention reads the pool through the block table. For the batch-invariant attention (`KVPool`) each row has
`ctx_len` key slots (slots past the sequence are zeros, the zero block's) and the attention runs over all of
them under the mask, exactly as the trainer's whole-sequence pass and the static engine's cache do, so the bits
do not depend on the layout; only the slots the rows' blocks hold are gathered. For torch's SDPA (`LivePool`,
determinism off) the keys are those slots only, as a serving engine's paged attention reads them: the key
length follows the batch's widest row.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from detrl.models.decode_attention import decode_width
from detrl.models.forward import Weights, layer_post, layer_pre, unique_writes
from detrl.models.ops import Ops, sdpa_attention


@dataclass(frozen=True)
class PoolSpec:
    """The paged engines' pool knobs, as the run's config gives them (`from_config`); the defaults are the CPU
    engine's own (a device engine passes its own defaults)."""

    block_size: int = 8  # KV tokens per pool block
    prefill_chunk: int = 64  # prompt tokens a sequence prefills per step
    kv_pool_tokens: int = 0  # KV tokens of a pool; 0 = automatic (`pool_blocks`)
    kv_pool_max_tokens: int = 0  # the cap on an automatic pool; 0 = none

    @classmethod
    def from_config(cls, rollout) -> PoolSpec:
        """From a RolloutConfig."""
        return cls(
            rollout.block_size, rollout.prefill_chunk, rollout.kv_pool_tokens, rollout.kv_pool_max_tokens
        )

    def blocks(self, free_bytes: int | None, token_bytes: int, ctx_len: int, max_running: int) -> int:
        """`pool_blocks` with this spec's block size, explicit size and cap."""
        return pool_blocks(
            free_bytes, token_bytes, ctx_len, self.block_size, max_running, self.kv_pool_tokens,
            self.kv_pool_max_tokens,
        )  # fmt: skip


def kv_token_bytes(config, itemsize: int) -> int:
    """Bytes of KV one token holds: 2 (K and V) x layers x Hkv x head_dim x itemsize."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def pool_blocks(
    free_bytes: int | None,
    token_bytes: int,
    ctx_len: int,
    block_size: int,
    max_running: int,
    tokens: int,
    cap: int,
) -> int:
    """Blocks of one pool: `tokens`, or when 0 what `max_running` full contexts need within the cap (0: none);
    then within half of `free_bytes` (None: no bound), and never fewer than one full context's blocks."""
    want = tokens or min(max_running * ctx_len, cap or max_running * ctx_len)
    if free_bytes is not None:
        want = min(want, free_bytes // 2 // token_bytes)
    return max(-(-ctx_len // block_size), want // block_size)


class Plan(NamedTuple):
    """What one step's layers share (`KVPool.plan`)."""

    write: torch.Tensor  # flat pool slots the valid tokens write, head by head
    valid: torch.Tensor | None  # [B Hkv T] the tokens that write (None: all)
    read: torch.Tensor  # [B, Hkv, blocks] the pool blocks each row reads per head
    width: int  # the key slots read per row
    fresh: bool  # a cold prefill whose own keys are read (`_padded`), not gathered


@dataclass
class Block:
    ref: int = 0
    hash: int | None = None  # set once the block is full and its KV written
    tokens: tuple[int, ...] = ()  # the tokens it holds (a hash hit is checked against them)


@dataclass
class SeqBlocks:
    """A sequence's block table and the pool slots of its ctx_len positions."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # the chain hash of each full block so far
    row: np.ndarray | None = None  # `padded`'s: the table's first `synced` ids, then the zero block's
    synced: int = 0

    def padded(self, width: int, zero: int) -> np.ndarray:
        """The table as a row of `width` block ids, padded with `zero` (the zero block's id), kept across steps
        and brought up to date with the blocks appended since (a table only grows): a step's tables cost a
        stack of rows, not ctx_len / block_size Python ints a row (9.5 ms a step at 64 rows of 1,280 blocks)."""
        if self.row is None:
            self.row = np.full(width, zero, dtype=np.int64)
        n = min(len(self.table), width)
        if n > self.synced:
            self.row[self.synced : n] = self.table[self.synced : n]
            self.synced = n
        return self.row


class KVPool:
    """Per layer K and V [blocks + 2, block_size, Hkv, D]: block `blocks` stays zero (unused key slots), block
    `blocks + 1` is a sink no row reads (the padding rows of a CUDA graph's bucket write there)."""

    def __init__(
        self,
        config,
        blocks: int,
        block_size: int,
        dtype: torch.dtype,
        ctx_len: int,
        device: torch.device | str = "cpu",
    ):
        self.blocks, self.block_size, self.ctx_len, self.device = (
            blocks,
            block_size,
            ctx_len,
            torch.device(device),
        )
        self.hkv, self.size = config.num_key_value_heads, (blocks + 2) * block_size  # slots per head
        self.sink_slot = (blocks + 1) * block_size  # a slot no row reads
        self.head_dim, self.dtype = config.head_dim, dtype
        shape = (self.hkv * self.size, config.head_dim)  # head-major: a row's gather is one copy
        layers = config.num_hidden_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.block_bytes = 2 * layers * block_size * self.hkv * shape[1] * self.k[0].element_size()
        self._heads = torch.arange(self.hkv, device=device) * self.size  # [Hkv] offset of each head's slots
        self._head_blocks = self._heads // block_size  # [Hkv] ... and of its blocks
        self._pad: torch.Tensor | None = None  # [2 (K, V), B, Hkv, ctx_len, D], reused by `_padded`
        self._dirty = 0  # the widest slot `_pad` holds + 1: past it, it is zeros
        self._read: torch.Tensor | None = None  # [2 (K, V), blocks, block_size D], reused by `_gathered`
        # on CUDA the caching allocator makes a fresh buffer cheap, and a buffer kept across calls would tie a
        # captured graph to memory an eager call may free
        self._reuse = self.device.type == "cpu"

    def zero_slots(self) -> torch.Tensor:
        """The flat pool indices of the zero block's slots, in every head."""
        zero = self.blocks * self.block_size + torch.arange(self.block_size, device=self.device)
        return (self._heads[:, None] + zero).reshape(-1)

    def mask(self, positions: torch.Tensor, table: torch.Tensor, plan: Plan):
        """What the op set's attention takes as its mask: [B, 1, T, ctx_len] key <= the query's position."""
        return (
            torch.arange(self.ctx_len, device=positions.device)[None, None, None, :]
            <= positions[:, None, :, None]
        )

    def table(self, tables: list[list[int]]) -> torch.Tensor:
        """[B, ceil(ctx_len / block_size)] the block of each row's positions, padded with the zero block's id:
        what a step's layers read the pool through."""
        return self.tables([SeqBlocks(t) for t in tables])  # `padded` reads a table, never writes it

    def tables(self, rows: list[SeqBlocks]) -> torch.Tensor:
        """`table` of the rows' sequences, from their kept padded rows (`SeqBlocks.padded`)."""
        width = -(-self.ctx_len // self.block_size)
        return torch.from_numpy(np.stack([r.padded(width, self.blocks) for r in rows]))

    def token_slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] the pool slot of each token at positions [B, T] of rows with these block tables."""
        bs = self.block_size
        return table.gather(1, torch.div(positions, bs, rounding_mode="floor")) * bs + positions % bs

    pads = True  # a step other than a decode reads all ctx_len slots (`_padded`)

    def plan(
        self,
        write: torch.Tensor,
        valid: torch.Tensor | None,
        table: torch.Tensor,
        fresh: bool = False,
        width: int | None = None,
    ) -> Plan:
        """The flat indices one step's layers share: where tokens [B, T] (where `valid`; None: all) write, what
        rows read per head: [B, Hkv, W], the first W of their ctx_len slots, W the most blocks any row holds
        (every slot past W is the zero block's, in every row), widened as `read_width` says, as the pool blocks
        that hold them: [B, Hkv, ceil(W / block_size)] rows of the pool seen as [Hkv (blocks + 2), block_size D].
        `fresh`: every row's tokens start at position 0 (a cold prefill), so what the step writes is all its rows
        hold and the step's own keys are read, not gathered back (the slots differ at masked keys only).
        `table` [B, blocks]: each row's block table (`table`). `width`: W as the caller knows it (None: counted
        from `table`, a host sync on a device), or any width >= W (a CUDA graph's bucket)."""
        w = (write[:, None, :] + self._heads[None, :, None]).reshape(-1)  # [B Hkv T]
        mask = None if valid is None else valid[:, None, :].expand(-1, self.hkv, -1).reshape(-1)
        width = self.read_width(self.width(table) if width is None else width, write.shape[1] == 1)
        read = table[:, None, : -(-width // self.block_size)] + self._head_blocks[None, :, None]
        return Plan(w if mask is None else w[mask], mask, read, width, fresh and self.pads)

    def read_width(self, width: int, decode: bool) -> int:
        """The slots a step reads per row: a decode step (one token a row) the narrowest key width the invariant
        attention admits for ctx_len (`decode_attention.decode_width`: the same bits as all ctx_len keys) that covers W,
        read as they are; any other step W, padded to ctx_len by `_padded`."""
        if not decode:
            return width
        return decode_width(self.head_dim, self.ctx_len, self.dtype, self.device, width)

    def width(self, table: torch.Tensor) -> int:
        """W: the slots the widest row of block tables [B, blocks] holds in real blocks (real blocks, then the zero
        block's id), at most ctx_len."""
        return min(self.ctx_len, int((table < self.blocks).sum(1).max()) * self.block_size)

    def graph_width(self, width: int) -> int:
        """The width a captured decode step reads for a batch of width W: W's power-of-two bucket (>= one block,
        <= ctx_len), so that few graphs serve every step."""
        return min(self.ctx_len, max(self.block_size, 1 << max(0, width - 1).bit_length()))

    def write_read(self, layer: int, k, v, plan: Plan):
        """Write k, v [B, Hkv, T, D] at the plan's slots, then gather keys, values: a decode step's [B, Hkv, W,
        D] (the first W of the mask's ctx_len keys: the invariant attention takes the rest as masked zeros),
        any other step's [B, Hkv, ctx_len, D], the plan's W slots then zeros (the zero block's values, without
        gathering them)."""
        self.write(layer, k, v, plan)
        if plan.fresh:  # the keys are the step's own
            return self._padded(k, v)
        keys, values = self._gathered(layer, plan.read, plan.width)
        return (keys, values) if k.shape[2] == 1 else self._padded(keys, values)

    def write(self, layer: int, k, v, plan: Plan) -> None:
        """k, v [B, Hkv, T, D] into the layer's pool at the plan's slots (its valid tokens only)."""
        d = k.shape[-1]
        with unique_writes():  # a token's slot is its own: on CUDA, no sort-based deterministic index_put
            for pool, x in ((self.k[layer], k), (self.v[layer], v)):
                rows = x.reshape(-1, d)
                pool.index_copy_(0, plan.write, rows if plan.valid is None else rows[plan.valid])

    def _gathered(self, layer: int, read: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks `read` [B, Hkv, nb] of the layer's K and V -> their first `width` slots [B, Hkv, W, D] each,
        copied a block at a time into a reused buffer (shared by the layers like `_pad`: a fresh multi-MB
        tensor per layer and step costs more than the copy, and so do slot-sized copies)."""
        (b, h, nb), row = read.shape, self.block_size * self.head_dim
        buf = self._read if self._reuse else None
        if buf is None or buf.shape[1] < read.numel():
            buf = self.k[layer].new_empty((2, read.numel(), row))
            self._read = buf if self._reuse else None
        out = buf[:, : read.numel()]
        for pool, dst in zip((self.k[layer], self.v[layer]), out, strict=True):
            torch.index_select(pool.view(-1, row), 0, read.reshape(-1), out=dst)
        return tuple(x.view(b, h, nb * self.block_size, self.head_dim)[:, :, :width] for x in out)

    def _padded(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [B, Hkv, W, D] -> [B, Hkv, ctx_len, D] in a reused buffer (shared by the layers: a layer's
        are read before the next layer gathers) whose slots past W are kept zero, the zero block's values: the
        gather reads W slots a row, not ctx_len."""
        b, h, width, d = keys.shape
        if width == self.ctx_len:
            return keys, values
        if self._pad is None or self._pad.shape[1] < b:
            self._pad, self._dirty = keys.new_zeros((2, b, h, self.ctx_len, d)), 0
        if self._dirty > width:
            self._pad[:, :, :, width : self._dirty].zero_()
        self._dirty = width
        out = self._pad[:, :b]
        out[0, :, :, :width], out[1, :, :, :width] = keys, values
        return out[0], out[1]


class LivePool(KVPool):
    """A pool read as a serving engine's paged attention reads it: the keys of the W slots the step's widest row
    holds, not ctx_len; the key length, hence the attention's reduction, changes with the batch's make-up. For
    an attention that reduces over any length (torch's SDPA); the batch-invariant one needs ctx_len, or for a
    decode step a width it proved equal to it (KVPool)."""

    pads = False

    def mask(self, positions: torch.Tensor, table: torch.Tensor, plan: Plan):
        """[B, 1, T, W] key <= the query's position (W: the plan's read width)."""
        keys = torch.arange(plan.width, device=positions.device)
        return keys[None, None, None, :] <= positions[:, None, :, None]

    def read_width(self, width: int, decode: bool) -> int:
        return width

    def _padded(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values


def pool_for(ops: Ops) -> type[KVPool]:
    """The gathering pool for an op set's attention: torch's SDPA reads the rows' slots only (LivePool), any
    other attention (the batch-invariant set's) all ctx_len of them, a decode step its admitted width (KVPool)."""
    return LivePool if ops.attention is sdpa_attention else KVPool


class BlockManager:
    """Allocation, reference counts and the hash table of full blocks over one pool's block ids."""

    def __init__(self, blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block() for _ in range(blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(blocks))  # oldest freed first
        self.by_hash: dict[int, int] = {}
        self.used_peak = 0

    @staticmethod
    def chain(prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((0 if prev is None else prev, tokens))

    def used(self) -> int:
        return len(self.blocks) - len(self.free)

    def chain_of(self, tokens: list[int]) -> list[int]:
        """The chain hash of each full block of `tokens`."""
        out, prev, bs = [], None, self.block_size
        for j in range(len(tokens) // bs):
            prev = self.chain(prev, tuple(tokens[j * bs : (j + 1) * bs]))
            out.append(prev)
        return out

    def cached(self, chain: list[int], tokens: list[int]) -> list[int]:
        """Ids of the longest run of computed blocks under these chain hashes (their tokens checked)."""
        out, bs = [], self.block_size
        for j, h in enumerate(chain):
            bid = self.by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != tuple(tokens[j * bs : (j + 1) * bs]):
                break
            out.append(bid)
        return out

    def take(self, bid: int) -> None:
        """One more reference to a cached block (out of the free list if it was there)."""
        self.blocks[bid].ref += 1
        self.free.pop(bid, None)
        self.used_peak = max(self.used_peak, self.used())

    def allocate(self) -> int:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None and self.by_hash.get(blk.hash) == bid:
            del self.by_hash[blk.hash]
        blk.ref, blk.hash, blk.tokens = 1, None, ()
        self.used_peak = max(self.used_peak, self.used())
        return bid

    def release(self, table: list[int]) -> None:
        for bid in reversed(table):  # the tail first: it is the least likely to be shared again
            blk = self.blocks[bid]
            blk.ref -= 1
            if blk.ref == 0:
                self.free[bid] = None

    def publish(self, bid: int, prev: int | None, tokens: tuple[int, ...]) -> int:
        """Mark a full, computed block as cached under its chain hash; -> the hash."""
        h = self.chain(prev, tokens)
        blk = self.blocks[bid]
        blk.hash, blk.tokens = h, tokens
        self.by_hash.setdefault(h, bid)
        return h

    def clear(self) -> None:
        """Forget every cached block (the weights changed)."""
        self.by_hash.clear()
        for blk in self.blocks:
            blk.hash, blk.tokens = None, ()


def paged_forward(
    w: Weights, tokens, positions, ops: Ops, ctx_len: int, rope, pool: KVPool, write, valid, table, last,
    fresh: bool = False, width: int | None = None,
):  # fmt: skip
    """`forward` over the paged cache: tokens [B, T] at positions [B, T] (right-padded where not `valid`; None:
    none padded), their KV written at `write` [B, T], attention over each row's blocks through its block table
    `table` [B, blocks] (`fresh`: every row starts at position 0; `width`: see `KVPool.plan`). -> (logits [B, V]
    at `last` [B], ids [B, layers, k] the experts each layer chose at `last`, None when dense)."""
    c = w.config
    b = tokens.shape[0]
    cos, sin = rope
    rot = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, T, 1, D]
    eps, hd = c.rms_norm_eps, c.head_dim
    top_k, norm_topk = getattr(c, "num_experts_per_tok", 0), getattr(c, "norm_topk_prob", False)
    h = w.embed[tokens]  # [B, T, H]
    rows = torch.arange(b, device=tokens.device)
    plan = pool.plan(write, valid, table, fresh, width)
    mask = pool.mask(positions, table, plan)  # [B, 1, T, L] (or what the pool's attention reads instead)
    chosen = []
    for i, lw in enumerate(w.layers):
        q, k, v = layer_pre(h, lw.input_norm, lw.qkv, lw.qk_norm, *rot, ops, c.num_attention_heads, hd, eps)
        keys, values = pool.write_read(i, k, v, plan)
        h, ids = layer_post(
            h, q, keys, values, mask, lw.o, lw.post_norm, lw.gate_up, lw.down, lw.router,
            ops, top_k, norm_topk, hd, eps,
        )  # fmt: skip
        chosen.append(None if ids is None else ids.view(b, -1, ids.shape[-1])[rows, last])
    h = ops.norm(h[rows, last], w.norm, eps)
    return ops.linear(h, w.lm_head), (None if chosen[0] is None else torch.stack(chosen, 1))
