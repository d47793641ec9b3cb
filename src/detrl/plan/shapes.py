"""The planner's inputs: a model's `Shapes`, one rank's `Workload`, the trainer's `Layout` (`TODAY`, `FSDP2`).

Pure data; the arithmetic over them is `detrl.plan.memory`."""

from __future__ import annotations

from dataclasses import dataclass

ATTN_QUERY_CHUNK = 1024  # query rows per recomputed attention piece (models/primitives.py ATTN_QUERY_CHUNK)


@dataclass(frozen=True)
class Shapes:
    """A Qwen3 / Qwen3-MoE model's shapes (experts=0: dense)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    @property
    def qkv(self) -> int:
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp(self) -> int:
        if self.experts:  # stacked gate|up and down per expert, plus the router
            return self.experts * 3 * self.hidden * self.moe_intermediate + self.experts * self.hidden
        return 3 * self.hidden * self.intermediate

    @property
    def block(self) -> int:
        """Parameters of one decoder block: q/k/v, o, q/k norms, two RMSNorms, the MLP."""
        return (
            self.qkv
            + self.heads * self.head_dim * self.hidden
            + 2 * self.head_dim
            + 2 * self.hidden
            + self.mlp
        )

    @property
    def embed(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embed * (1 if self.tied else 2) + self.hidden + self.layers * self.block

    @property
    def engine_elements(self) -> int:
        """Elements of an engine's weights, `fuse(model, dtype).map(clone)` (rollout/embedded.py, cuda.py,
        cuda_paged.py): every parameter once (q|k|v and gate|up concatenated: the same count), the q/k norms
        expanded to one row per head ([Hq + Hkv, D] for 2 D), and a tied lm_head cloned apart from the embedding."""
        norms = self.layers * (self.heads + self.kv_heads - 2) * self.head_dim
        return self.params + norms + (self.embed if self.tied else 0)

    @property
    def fused_copies(self) -> int:
        """Elements `fuse` copies even without a cast: the concatenated q|k|v and (dense) gate|up of every block."""
        gate_up = 0 if self.experts else 2 * self.hidden * self.intermediate
        return self.layers * (self.qkv + gate_up)

    def kv_per_token(self, dtype_bytes: int) -> int:
        """Bytes of keys and values one token holds across the layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Layout:
    """How the trainer places its state; `TODAY` reads as the code does now.

    gather: what an FSDP2 unshard materialises at once (`model`: every parameter, `block`: one decoder block
      plus its prefetched neighbour, the root's embedding and head staying gathered);
    gather_dtype: the gathered parameters' dtype (`master`: fp32, cast afterwards by `fuse`; `compute`:
      MixedPrecisionPolicy's param_dtype);
    reduce: the ordered (determinism=on) reducer's buffers (`stash`: every micro-batch's full fp32 gradient kept and
      all-gathered; `shard`: an fp32 accumulator shard plus one block's gradient and its all-to-all receive);
    construct: `full` builds the whole fp32 policy and reference on every rank before sharding, `sharded` only
      this rank's shards (the preflight then runs on one block);
    sync: the weight sync's full gathers (`full`: the fp32 state dict and the unsharded model at once, `block`);
    ref: the reference model on the `device` (sharded like the policy) or offloaded to `cpu`;
    kv: the CUDA engine's KV cache (`static`: [bucket, Hkv, ctx_len, D] per layer per bucket used, kept for the
      run; `paged`: a pool of min(kv_cap_tokens, rows x ctx_len) tokens, released during the update);
    attn_backward: the batch-invariant attention's backward (CPU `bi_attention`, CUDA Triton `attention`):
      `torch` holds [B, H, T, L] probabilities (CPU: every layer's saved; CUDA: one layer's fp32 recomputation);
      `pieces` (the code now: models/ops.py `query_chunked`, triton_attention.py `attention_backward`) recomputes
      the query rows in pieces of ATTN_QUERY_CHUNK, [B, H, min(T, ATTN_QUERY_CHUNK), L] at once (the CPU op cuts
      only T > ATTN_QUERY_CHUNK: shorter passes save every layer's probabilities as before); `flash` holds none.
    """

    gather: str = "model"
    gather_dtype: str = "master"
    reduce: str = "stash"
    construct: str = "full"
    sync: str = "full"
    ref: str = "device"
    kv: str = "static"
    kv_cap_tokens: int = 0  # paged: 0 = no cap
    attn_backward: str = "torch"

    def __post_init__(self):
        for name, valid in CHOICES.items():
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"layout.{name}={getattr(self, name)!r} is not valid; choose one of {list(valid)}"
                )


CHOICES = {
    "gather": ("model", "block"),
    "gather_dtype": ("master", "compute"),
    "reduce": ("stash", "shard"),
    "construct": ("full", "sharded"),
    "sync": ("full", "block"),
    "ref": ("device", "cpu"),
    "kv": ("static", "paged"),
    "attn_backward": ("torch", "pieces", "flash"),
}
TODAY = Layout()
FSDP2 = Layout("block", "compute", "shard", "sharded", "block", "device", "paged", attn_backward="flash")
LAYOUTS = {"today": TODAY, "fsdp2": FSDP2}


@dataclass(frozen=True)
class Workload:
    """What one rank runs: its device, dtypes and the step's sizes (all per rank unless said)."""

    device: str  # cpu | cuda
    compute_bytes: int  # 4 (fp32) or 2 (bf16)
    ctx_len: int  # every trainer sequence is padded to it
    micro_batch: int  # sequences per backward
    micro_batches: int  # micro-batches per mini-batch (all ranks together)
    batch_rows: int  # sequences of the step batch (every rank holds all of them)
    engine_requests: int  # requests of the largest engine call (rollout or eval), all ranks together
    engine_batch: int  # rollout.max_batch_size
    engine_workers: int = 1  # CPU engine: worker processes, each with its own batch's cache
    reference: bool = True  # algo.use_kl_loss
    preflight: bool = True  # determinism.kernels=batch_invariant
    ordered: bool = True  # determinism.reduce=ordered
    checkpointing: bool = False  # activation_checkpointing
    # materialised (every layer saves [B, H, T, L] probabilities) | recompute (the backward rebuilds one layer's
    # [B, H, T, L], fp32) | pieces (the backward rebuilds one piece of min(T, ATTN_QUERY_CHUNK) query rows) | flash
    attention: str = "materialised"
