"""Per-rank memory of a run as pure functions of shapes, dtypes and world size (no tensors are made).

A run passes through four phases, each holding a different set of parts; a rank's need is the largest phase:
- `preflight`: before step 0 (batch-invariance checks under determinism.kernels=batch_invariant);
- `score`: the no-grad pass of the policy and the reference (old and reference logprobs);
- `update`: a micro-batch's forward and backward, then the gradient reduce (the peak of most runs);
- `sync`: the new weights reach the engine; digests and drift sketches read the full parameters.
Each part's function says what it assumes next to it. Where the trainer's layout is changing, the choice is a
field of `Layout` (`TODAY`: the code as it is; `FSDP2`: FSDP2 per block with mixed precision), not a constant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from detrl.plan.shapes import (  # noqa: F401 (re-exported: the planner's inputs)
    ATTN_QUERY_CHUNK,
    CHOICES,
    FSDP2,
    LAYOUTS,
    TODAY,
    Layout,
    Shapes,
    Workload,
)

GIB = 2**30
MASTER = 4  # bytes: fp32 master weights, AdamW state and gradients on every device
HEAD_CHUNK = 2**24  # logits in one lm_head chunk (models/logprobs.py CHUNK_ELEMENTS, fp32)
RUNTIME = {"cpu": 0.5 * GIB, "cuda": 1.0 * GIB}  # process baseline: torch + transformers imported (CPU RSS
# measured 0.50 GiB); CUDA context, cuBLAS workspace and NCCL buffers (assumed)


def attention_mode(device: str, invariant: bool, attn_backward: str, ctx_len: int) -> str:
    """The `Workload.attention` of an op set. Default kernels (invariant=False): SDPA, flash-style on both devices
    (CUDA `cuda_attention`: is_causal flash; CPU `sdpa_attention`: torch's CPU flash kernel, which saves the mask
    and the logsumexp, no probabilities). Batch-invariant: per `Layout.attn_backward` (`pieces`: on CPU a pass of
    ctx_len <= ATTN_QUERY_CHUNK rows is one `bi_attention_rows` call, materialised)."""
    if not invariant or attn_backward == "flash":
        return "flash"
    if attn_backward == "torch":
        return "materialised" if device == "cpu" else "recompute"
    return "materialised" if device == "cpu" and ctx_len <= ATTN_QUERY_CHUNK else "pieces"


def _shard(nbytes: float, world: int) -> float:
    return nbytes / world


def resident(s: Shapes, w: Workload, lay: Layout, world: int) -> dict[str, float]:
    """Parts every phase after the build holds."""
    p, c = s.params, w.compute_bytes
    # either engine: its fused weights in the compute dtype and nothing else (CPU: in shared memory, which its
    # worker processes read; a sync copies each state-dict entry into its view, rollout/weight_views.py)
    engine = s.engine_elements * c
    on_device_ref = w.reference and not (lay.ref == "cpu" and w.device == "cuda")
    return {
        "runtime": RUNTIME[w.device],
        "master weights": _shard(p * MASTER, world),  # FSDP2 shards (world 1: the parameters)
        "optimizer state": _shard(2 * p * MASTER, world),  # AdamW exp_avg + exp_avg_sq, fp32, on the shards
        "reference model": _shard(p * MASTER, world) if on_device_ref else 0.0,  # a deepcopy of the policy
        "engine weights": engine,  # a full copy on every rank (each rank's engine serves its share)
        "KV pool": kv_pool(s, w, lay, world),
        # input ids (int64) and ~10 [N, L] fp32 tensors: mask, rollout / old / ref logprobs, entropy, advantages...
        "step batch": w.batch_rows * w.ctx_len * (8 + 10 * 4),
        # rank 0's drift sketch (fingerprint.param_sketch): on CPU the bit-packed signs (P / 8 bytes), one
        # 256 x 4096 float64 block and the 256 x 4096 float64 Gaussian; on CUDA three float64 chunks of 2**24
        "drift sketch": p / 8 + 2 * 256 * 4096 * 8 if w.device == "cpu" else 3 * 2**24 * 8,
    }


def engine_rows(w: Workload, world: int) -> int:
    """Rows of this rank's largest engine batch: its share of the call (each rank serves requests / W), cut into
    batches of <= max_batch_size (CPU: spread over the workers, each running one batch at a time)."""
    share = -(-w.engine_requests // world)
    if w.device == "cpu":
        share = -(-share // w.engine_workers)
    return max(1, min(w.engine_batch, share))


def kv_pool(s: Shapes, w: Workload, lay: Layout, world: int) -> float:
    """The engine's KV cache, rows = `engine_rows`, bytes per token = 2 x layers x Hkv x head_dim x dtype.
    CPU: each worker's batch cache (its own process). CUDA static: [bucket, Hkv, ctx_len, D] per layer for the
    bucket (next power of two) of the largest batch, kept for the run (a smaller bucket used later, e.g. the
    eval's, adds its own); paged: a pool of min(kv_cap_tokens, rows x ctx_len) tokens (what the largest batch
    needs when every row reaches ctx_len)."""
    rows, per_token = engine_rows(w, world), s.kv_per_token(w.compute_bytes)
    if w.device == "cpu":
        return min(w.engine_workers, -(-w.engine_requests // world)) * rows * w.ctx_len * per_token
    if lay.kv == "static":
        return (1 << max(0, (rows - 1).bit_length())) * w.ctx_len * per_token
    tokens = rows * w.ctx_len
    return min(tokens, lay.kv_cap_tokens or tokens) * per_token


def gathered(s: Shapes, w: Workload, lay: Layout, world: int, fused: bool = True) -> float:
    """The parameters a forward reads at once, as FSDP2's unshard leaves them, plus (fused) `fuse`'s copies of
    them, which live until the backward has run."""
    c = w.compute_bytes
    if world == 1:  # plain modules: the forward reads the fp32 parameters themselves, `fuse` over all blocks
        return (s.params if c != MASTER else s.fused_copies) * c * fused
    if (
        lay.gather == "block"
    ):  # one block and its prefetched neighbour; the root (embedding, head) stays gathered
        count = 2 * s.block + s.params - s.layers * s.block
        cats = 2 * s.fused_copies / s.layers
    else:
        count, cats = s.params, s.fused_copies
    g = MASTER if lay.gather_dtype == "master" else c
    return (
        count * g + (count if c != g else cats) * c * fused
    )  # a cast copies every parameter, else the concats


def layer_activation(s: Shapes, w: Workload) -> float:
    """Bytes one token saves for the backward in one decoder block (counted from models/forward.py and ops.py):
    the two RMSNorms (input and output, 3 H each), q|k|v and their norm / rope outputs ((Hq + Hkv) D x 4 + Hkv D),
    the attention output and its reshape (2 Hq D); dense MLP: gate|up (2 I), the SiLU's intermediates (2 I) and
    the product (I); MoE: that per routed expert row plus the dispatched rows (2 H per pick) and the router's
    fp32 logits and probabilities (2 E x 4 B)."""
    hd = s.head_dim
    elems = 6 * s.hidden + 4 * (s.heads + s.kv_heads) * hd + s.kv_heads * hd + 2 * s.heads * hd
    if s.experts:
        elems += s.top_k * (5 * s.moe_intermediate + 2 * s.hidden)
        extra = 2 * s.experts * 4
    else:
        elems += 5 * s.intermediate
        extra = 0
    return elems * w.compute_bytes + extra


def query_rows(w: Workload) -> int:
    """Query rows whose scores are live at once: a piece's (pieces), else the whole pass."""
    return min(w.ctx_len, ATTN_QUERY_CHUNK) if w.attention == "pieces" else w.ctx_len


def attention_scores(s: Shapes, w: Workload, seqs: int) -> float:
    """One [seqs, Hq, rows, L] score tensor (rows: `query_rows`): materialised in the compute dtype (the CPU op's
    softmax runs in it); recompute / pieces on CUDA in fp32 (the Triton backward's softmax), on CPU in the compute
    dtype; flash: none."""
    if w.attention == "flash":
        return 0.0
    fp32 = w.attention == "recompute" or (w.attention == "pieces" and w.device == "cuda")
    nbytes = 4 if fp32 else w.compute_bytes
    return seqs * s.heads * query_rows(w) * w.ctx_len * nbytes


def attention_mask(w: Workload, seqs: int) -> float:
    """The forward's [seqs, 1, T, L] bool mask (models/forward.py), built once a pass and held to the end of the
    backward (saved by the attention ops, captured by checkpointed layers)."""
    return seqs * w.ctx_len * w.ctx_len


def attention_backward(s: Shapes, w: Workload, seqs: int) -> float:
    """The attention's backward beyond what the forward saved, for the one layer (and piece) it runs at a time: 3
    score tensors at its peak (the saved probabilities, their gradient, the softmax's input gradient; counted from
    ops.bi_attention_rows and triton_attention._attention_torch). CUDA (recompute, pieces): plus the recomputation's
    grouped-query keys and values repeated to [seqs, Hq, L, D] and the values' gradient, and (more than one
    piece) the fp32 dk / dv accumulators [seqs, Hkv, L, D]. Flash: none counted."""
    if w.attention == "flash":
        return 0.0
    extra = 0.0
    if w.device == "cuda" and w.attention in ("recompute", "pieces"):
        extra = 3 * seqs * s.heads * w.ctx_len * s.head_dim * w.compute_bytes
        if query_rows(w) < w.ctx_len:
            extra += 2 * seqs * s.kv_heads * w.ctx_len * s.head_dim * 4
    return 3 * attention_scores(s, w, seqs) + extra


def head_chunks(s: Shapes, w: Workload, seqs: int, n: int) -> float:
    """n lm_head chunks of fp32 logits: <= 2**24 logits each, fewer when the scored rows are fewer."""
    return n * min(HEAD_CHUNK, seqs * w.ctx_len * s.vocab) * 4


def activations(s: Shapes, w: Workload) -> float:
    """A micro-batch's forward + backward (tokens = micro_batch x ctx_len, sequences padded to ctx_len).
    Without checkpointing every block's activations are saved (materialised: with its [B, H, T, L] probabilities
    and its own inverted [B, T, L] mask, `~mask` in bi_attention_rows), plus one block's worth for the backward's
    gradients; with it, each block's input and two blocks' worth (the recomputed block and its gradients). Either
    way the attention backward of one layer (`attention_backward`: one piece under `pieces`) and the pass's mask.
    Plus the head: the final hidden states and 4 lm_head chunks (logits, log-softmax, their gradient, the
    entropy's exp)."""
    tokens = w.micro_batch * w.ctx_len
    one = tokens * layer_activation(s, w)
    back = attention_backward(s, w, w.micro_batch)
    mask = attention_mask(w, w.micro_batch)
    if w.checkpointing:
        trunk = s.layers * tokens * s.hidden * w.compute_bytes + 2 * one + back
    elif w.attention == "materialised":  # each layer saved its probabilities; the top one's are among `back`
        probs = attention_scores(s, w, w.micro_batch)
        trunk = s.layers * (one + probs + mask) + one + back - probs
    else:  # recompute / pieces / flash: no probabilities saved in the forward
        trunk = (s.layers + 1) * one + back
    return trunk + mask + 2 * tokens * s.hidden * w.compute_bytes + head_chunks(s, w, w.micro_batch, 4)


def forward_attention(s: Shapes, w: Workload, seqs: int) -> float:
    """A no-grad pass's attention at its peak, one layer at a time: on CPU (the invariant op, materialised or
    pieces: without grad it runs whole) the masked scores and the probabilities, [seqs, Hq, T, L] each in the
    compute dtype, and the inverted mask; the Triton and SDPA forwards are flash-style (none)."""
    if w.attention == "flash" or w.device == "cuda":
        return 0.0
    whole = seqs * s.heads * w.ctx_len * w.ctx_len * w.compute_bytes
    return 2 * whole + attention_mask(w, seqs)


def scoring(s: Shapes, w: Workload, seqs: int) -> float:
    """A no-grad pass over `seqs` sequences: one block's activations and its attention (`forward_attention`) at
    a time, the pass's mask, the hidden states, and 2 lm_head chunks."""
    tokens = seqs * w.ctx_len
    hidden = 2 * tokens * s.hidden * w.compute_bytes
    attn = forward_attention(s, w, seqs) + attention_mask(w, seqs)
    return tokens * layer_activation(s, w) + attn + hidden + head_chunks(s, w, seqs, 2)


def gradients(s: Shapes, w: Workload, lay: Layout, world: int, reducing: bool) -> tuple[float, float]:
    """(gradients, reduce buffers) during the backward (reducing=False) or at the reduce's peak.

    world 1: autograd accumulates into the fp32 parameters' .grad. Ordered `stash` (today, determinism=on): the
    unsharded fp32 gradient of the micro-batch in flight and this rank's stashed ones (kmax = ceil(micro_batches /
    W) of them); the reduce adds the kmax x P buffer it sends, the W x kmax x P it receives (all_gather) and the
    summed copy, then the sharded gradients (P / W). `shard`: an fp32 accumulator shard plus one block's gradient
    (or the model's, gather=model) and its all-to-all receive. all_reduce (off): the unsharded gradient and the
    flat copy the all-reduce runs on."""
    p = s.params * MASTER
    if world == 1:
        return p, 0.0
    shard = p / world
    unit = s.block * MASTER if lay.gather == "block" else p  # an unsharded gradient at once
    if w.ordered and lay.reduce == "stash":
        kmax = -(-w.micro_batches // world)
        return (unit, (kmax - 1) * p) if not reducing else (shard, (2 * kmax + world * kmax + 1) * p)
    if w.ordered:
        return shard + unit, unit
    return (unit, 0.0) if not reducing else (unit + shard, unit)


def weight_sync(s: Shapes, lay: Layout, world: int) -> float:
    """Transients of the engine's weight sync, the digests and the drift sketch. world 1: `fuse`'s fp32 concats
    (the state dict is the parameters). `full`: the gathered fp32 state dict and the unsharded model alive
    together, plus the concats; `block`: one block gathered in fp32 (and its concats) at a time."""
    if world == 1:
        return s.fused_copies * MASTER
    if lay.sync == "block":
        return 2 * (s.block + s.fused_copies / s.layers) * MASTER
    return (2 * s.params + s.fused_copies) * MASTER


def preflight(s: Shapes, w: Workload, lay: Layout, world: int, seqs: int = 8) -> dict[str, float]:
    """Before step 0 (models/preflight.py; the reference and the engine are built after it): `full` construction
    holds the whole fp32 policy on every rank, fuses it (a cast copies all), scores [8, ctx_len] as the trainer
    does (`scoring`: the lm_head in row chunks, no [8, ctx_len, V] logits), then prefills and decodes the 8 rows
    through a [8, ctx_len] KV cache of every layer; `sharded` (any run on several ranks):
    the rank's shards, the root group and block 0 gathered and fused (`first_block`), one block's check (its
    activations, the head in chunks, one layer's cache)."""
    c = w.compute_bytes
    if lay.construct == "sharded":  # preflight.first_block: the root group and block 0 gathered (fp32), fused
        root = s.params - s.layers * s.block
        copies = (root + s.block) * (MASTER + c)
        act = seqs * w.ctx_len * layer_activation(s, w)
        act += forward_attention(s, w, seqs) + attention_mask(w, seqs)
        act += head_chunks(s, w, seqs, 2) + seqs * w.ctx_len * s.kv_per_token(c) / s.layers
        master = _shard(s.params * MASTER, world)
    else:
        copies = (s.params if c != MASTER else s.fused_copies) * c
        act = scoring(s, w, seqs) + seqs * w.ctx_len * s.kv_per_token(c)
        master = s.params * MASTER
    return {
        "runtime": RUNTIME[w.device],
        "master weights": master,
        "reference model": 0.0,  # built after the preflight (trainer.start), as the engine is
        "compute copies": copies,
        "activations": act,
    }


PHASES = ("preflight", "rollout", "score", "backward", "reduce", "sync")


def phases(s: Shapes, w: Workload, lay: Layout, world: int) -> dict[str, dict[str, float]]:
    """Every phase's parts (bytes per rank)."""
    base = resident(s, w, lay, world)
    copies = gathered(s, w, lay, world)
    ref_held = 0.0  # scoring gathers the reference alongside the policy (both unsharded at once)
    if w.reference and world > 1 and not (lay.ref == "cpu" and w.device == "cuda"):
        count = s.params if lay.gather == "model" else 2 * s.block + s.params - s.layers * s.block
        ref_held = count * (MASTER if lay.gather_dtype == "master" else w.compute_bytes)
    out = {"preflight": preflight(s, w, lay, world)} if w.preflight else {}
    if (
        lay.kv == "paged" and w.device == "cuda"
    ):  # the pool exists while the engine generates, not in the update
        out["rollout"] = {**base, "activations": scoring(s, w, engine_rows(w, world)) / w.ctx_len}
        base = {**base, "KV pool": 0.0}
    out["score"] = {**base, "compute copies": copies + ref_held, "activations": scoring(s, w, w.micro_batch)}
    for phase, reducing in (("backward", False), ("reduce", True)):
        grads, buffers = gradients(s, w, lay, world, reducing)
        held = gathered(s, w, lay, world, fused=not reducing)  # the reduce: the backward freed fuse's copies
        out[phase] = {**base, "compute copies": held, "gradients": grads, "reduce buffers": buffers}
        out[phase]["activations"] = 0.0 if reducing else activations(s, w)
    out["sync"] = {**base, "gradients": 0.0, "weight sync": weight_sync(s, lay, world)}
    return out


@dataclass(frozen=True)
class Plan:
    phases: dict[str, dict[str, float]]  # bytes
    budget: float  # bytes per rank

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def parts(self) -> dict[str, float]:
        return self.phases[self.peak_phase]

    @property
    def per_rank(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.per_rank <= self.budget

    @property
    def largest(self) -> tuple[str, float]:
        return max(self.parts.items(), key=lambda kv: kv[1])


def plan(s: Shapes, w: Workload, lay: Layout, world: int, budget: float) -> Plan:
    if world < 1:
        raise ValueError(f"world size {world} is not valid: must be >= 1")
    return Plan(phases(s, w, lay, world), budget)


def min_world(s: Shapes, w: Workload, lay: Layout, budget: float, limit: int = 256) -> int | None:
    """The smallest world size (same per-rank workload) at which the plan fits, or None up to `limit`."""
    for world in range(1, limit + 1):
        if plan(s, w, lay, world, budget).fits:
            return world
    return None


def replace(w: Workload, **changes) -> Workload:
    return dataclasses.replace(w, **changes)
