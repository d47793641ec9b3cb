"""Batch invariance proven on the run's own device, dtype and shapes, before step 0 (issue 16, started).

`check(weights, ops, ctx_len, rope)` runs the forward the way the sampler and the trainer do and compares bits:
- rows: the trainer's forward over a batch of whole sequences vs the same sequence alone (batch of 1) and in a
  batch of another size: every row's logprobs must be equal;
- phases: the sampler's prefill + KV-cache decode of a sequence vs the trainer's forward over it: the logprob
  of every decoded token must be equal (trainer == rollout, bitwise).
- paged: the continuous engine's chunked prefill + decode through a paged KV pool (scrambled block tables) vs
  the trainer's forward (CPU: the worker's path; CUDA: the paged engine's, the Triton kernel reading the pool);
- gemm shapes: every distinct gemm weight shape (K, N) of the model (q/k/v, o, gate/up, down, router, lm_head,
  and the MoE block as a whole) over a spread of row counts (`ROWS`: 1..17, odd sizes, the engine's bucket
  sizes and their neighbours, at two offsets): the rows of each call must equal the same rows of one large call.
`require(...)` raises (fail-closed) when a check finds a difference; `negative_control(...)` runs the same checks
with the default op set and must find one (else the check proves nothing on this device).

`numerics_contract(...)` is what `train()` runs before step 0: under `determinism=on` it requires the checks
to pass with the run's op set, device, dtype, ctx_len and model (one line naming what varies, else the run does
not start; an FSDP2-sharded model is checked as a 1-layer model of its config on its gathered root group and block
0, `first_block`), runs the negative control with the device's default op set, and returns the run's "numerics
contract" (the result, the op sets, the device, versions and environment), written to <run_dir>/numerics.json.
"""

from __future__ import annotations

import os

import torch

from detrl import fsdp
from detrl.config import ConfigError
from detrl.models.forward import KVCache, Weights, forward, fuse, token_logprobs
from detrl.models.ops import Ops


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_logprobs(logits, targets, 1.0)[0]


def _trainer_logprobs(weights: Weights, ids: torch.Tensor, ops: Ops, ctx_len: int, rope) -> torch.Tensor:
    """Every next token's logprob [B, L-1] as the trainer scores them (`sequence_logprobs`: the lm_head over row
    chunks, never the [B, L, V] logits: 8 x 22,528 x 151,936 fp32 would be 102 GiB)."""
    from detrl.models.logprobs import sequence_logprobs

    mask = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    return sequence_logprobs(weights, ids, mask, ops, ctx_len, rope, 1.0)[0]


class PreflightError(ConfigError):
    """determinism=on cannot be honoured here: the check found a row or phase that varies (one line)."""


ROWS = {
    "cuda": (
        *range(1, 18),
        *(23, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 299, 300),
        *(511, 512, 513, 1023, 1024, 1025, 2055),  # the decode buckets above 300, and mid-size tiles
    ),
    "cpu": (1, 5, 16, 17, 33),
}  # cheap on the CPU: the CPU tests run it
# rows of the reference call the spread is compared with. On CUDA it must launch every gemm shape unsplit with the
# training-size tiles (as training batches run), while the small calls of the spread run split-K: 4,480 rows fill
# 132 SMs for every N >= 128 (triton_ops.splits; tested on the presets' shapes), so both launch paths are compared
REFERENCE_ROWS = {"cuda": 4480, "cpu": max(ROWS["cpu"]) + 7}


def gemm_shapes(weights: Weights) -> dict[str, torch.Tensor]:
    """One weight per distinct gemm of the model, by name (every layer has layer 0's shapes)."""
    lw = weights.layers[0]
    named = {"linear q/k/v": lw.qkv, "linear o": lw.o, "linear lm_head": weights.lm_head}
    if lw.router is None:
        named |= {"linear gate/up": lw.gate_up, "linear down": lw.down}
    else:
        named["linear router"] = lw.router
    return named


@torch.no_grad()
def check_rows(weights: Weights, ops: Ops, seed: int = 0) -> list[str]:
    """Each gemm shape (and the MoE block) on m rows at offset o vs the same rows of one call on every row."""
    dev, dtype = weights.embed.device, weights.embed.dtype
    spread, total = ROWS[dev.type], REFERENCE_ROWS[dev.type]
    g = torch.Generator().manual_seed(seed)
    calls = {
        f"{name} (K={w.shape[-1]}, N={w.shape[0]})": (w.shape[-1], lambda x, w=w: ops.linear(x, w))
        for name, w in gemm_shapes(weights).items()
    }
    lw, c = weights.layers[0], weights.config
    if lw.router is not None:

        def moe(x):
            top_w, top_i = ops.route(ops.linear(x, lw.router), c.num_experts_per_tok, c.norm_topk_prob)
            return ops.moe(x, top_w, top_i, lw.gate_up, lw.down, ops.linear, ops.silu)

        calls[f"moe (E={lw.gate_up.shape[0]}, K={lw.gate_up.shape[-1]}, I={lw.down.shape[-1]})"] = (
            lw.gate_up.shape[-1],
            moe,
        )
    found = []
    for what, (k, fn) in calls.items():
        x = (torch.randn(total, k, generator=g) * 0.5).to(dev, dtype)
        ref = fn(x)
        bad = next(
            ((m, o) for m in spread for o in (0, 7) if not torch.equal(fn(x[o : o + m]), ref[o : o + m])),
            None,
        )
        if bad:
            m, o = bad
            diff = (fn(x[o : o + m]) - ref[o : o + m]).float().abs().max().item()
            found.append(
                f"{what}: rows {o}..{o + m - 1} of a {m}-row call differ from the same rows of a "
                f"{total}-row call (max diff {diff:.3g})"
            )
    return found


@torch.no_grad()
def check(
    weights: Weights, ops: Ops, ctx_len: int, rope, batch: int = 8, prompt_len: int = 3, seed: int = 0
) -> list[str]:
    """Differences found (empty: invariant on these shapes): the gemm shapes over row counts, then the trainer's
    rows and the sampler's phases on sequences of random tokens on the weights' device."""
    found = check_rows(weights, ops, seed)
    dev, vocab = weights.embed.device, weights.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, ctx_len), generator=g).to(dev)
    full = _trainer_logprobs(weights, ids, ops, ctx_len, rope)  # [B, L-1]
    for rows in (slice(0, 1), slice(1, 1 + max(1, batch // 2 - 1))):  # alone, and in a batch of another size
        part = _trainer_logprobs(weights, ids[rows], ops, ctx_len, rope)
        if not torch.equal(part, full[rows]):
            found.append(
                f"rows {rows.start}..{rows.stop - 1}: trainer logprobs depend on the batch "
                f"(max diff {(part - full[rows]).abs().max().item():.3g})"
            )
    cache = KVCache.empty(weights.config, batch, ctx_len, weights.embed.dtype, dev)
    last = forward(
        weights,
        ids[:, :prompt_len],
        ops,
        ctx_len,
        rope,
        cache=cache,
        last=torch.full((batch,), prompt_len - 1, device=dev),
    )  # [B, V]
    decoded = []
    for pos in range(prompt_len, min(ctx_len, prompt_len + 6)):
        tok = ids[:, pos]
        decoded.append(_logprobs_of(last, tok))
        last = forward(
            weights,
            tok[:, None],
            ops,
            ctx_len,
            rope,
            cache=cache,
            positions=torch.full((batch, 1), pos, device=dev),
        )[:, 0]
    decoded = torch.stack(decoded, 1)  # [B, steps]
    want = full[:, prompt_len - 1 : prompt_len - 1 + decoded.shape[1]]
    if not torch.equal(decoded, want):
        found.append(
            f"prefill + decode vs the trainer's forward: logprobs differ (max diff "
            f"{(decoded - want).abs().max().item():.3g})"
        )
    return found + check_paged(weights, ops, ctx_len, rope, ids, full, prompt_len)


@torch.no_grad()
def check_paged(weights: Weights, ops: Ops, ctx_len: int, rope, ids, full, prompt_len: int) -> list[str]:
    """The continuous engine's path: the prompt prefilled in chunks of 2 through a paged pool whose block tables
    are interleaved and reversed, then decoded; every decoded logprob must equal the trainer's `full`. On CPU the
    worker's op set over gathered keys; on a device the paged engine's own (`cuda_paged.device_ops`: under the
    invariant set the Triton kernel reads the pool in place through the block tables)."""
    from detrl.rollout.paged import paged_forward

    dev = weights.embed.device
    b, size = ids.shape[0], 4
    per = -(-ctx_len // size)
    ops, pool = _paged_pool(weights, ops, ctx_len, b * per, size)
    table = pool.table([[j * b + i for j in reversed(range(per))] for i in range(b)]).to(dev)
    steps, p, got = min(ctx_len, prompt_len + 6), 0, []
    while p < steps - 1:
        n = min(2, prompt_len - p) if p < prompt_len else 1
        pos = torch.arange(p, p + n, device=dev).expand(b, n)
        valid = torch.ones(b, n, dtype=torch.bool, device=dev)
        last = torch.full((b,), n - 1, device=dev)
        logits, _ = paged_forward(
            weights,
            ids[:, p : p + n],
            pos,
            ops,
            ctx_len,
            rope,
            pool,
            pool.token_slots(table, pos),
            valid,
            table,
            last,
        )
        p += n
        if p >= prompt_len:
            got.append(_logprobs_of(logits, ids[:, p]))
    got, want = torch.stack(got, 1), full[:, prompt_len - 1 : steps - 1]
    if torch.equal(got, want):
        return []
    return [f"paged chunked prefill + decode vs the trainer's forward: logprobs differ (max diff "
            f"{(got - want).abs().max().item():.3g})"]  # fmt: skip


def _paged_pool(weights: Weights, ops: Ops, ctx_len: int, blocks: int, size: int):
    """(ops, pool) as the run's engine on this device builds them (CPU worker: the ops as given, `pool_for` them)."""
    from detrl.rollout.cuda_paged import device_ops
    from detrl.rollout.paged import pool_for

    pool_type = pool_for(ops)
    if ops.name.startswith("cuda_"):  # the CUDA op sets (on CPU too: Triton's interpreter, in the tests)
        ops, pool_type = device_ops(ops)
    return ops, pool_type(
        weights.config, blocks, size, weights.embed.dtype, ctx_len, device=weights.embed.device
    )


def require(weights: Weights, ops: Ops, ctx_len: int, rope, **kw) -> None:
    found = check(weights, ops, ctx_len, rope, **kw)
    if found:
        raise PreflightError(
            f"determinism=on refused: batch invariance not proven on {weights.embed.device} "
            f"({weights.embed.dtype}, ops {ops.name}): {found[0]}"
        )


def negative_control(weights: Weights, ops: Ops, ctx_len: int, rope, **kw) -> list[str]:
    """The same checks with `ops` = a default op set: what they find (expected: something, on a GPU)."""
    return check(weights, ops, ctx_len, rope, **kw)


ENV_KEYS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "NCCL_ALGO",
    "GOMP_SPINCOUNT",
    "OMP_NUM_THREADS",
)


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return "unknown"


def _contract(rt) -> dict:
    """What the run's bits depend on: device, dtype, op set and its kernels, library versions, env."""
    import torch

    from detrl.device import device_name

    kernels = ("linear", "norm", "attention", "silu", "route", "moe", "linear_add", "silu_mul", "norm_rope")
    contract = {
        "device": device_name(rt.device),
        "dtype": str(rt.dtype),
        "ops": rt.ops.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "kernels": {
            f: getattr(getattr(rt.ops, f), "__qualname__", repr(getattr(rt.ops, f)))
            for f in kernels
            if getattr(rt.ops, f) is not None
        },
    }
    if rt.cuda:
        contract["driver"] = _driver_version()
    else:
        contract["host"] = cpu_host()
    try:
        import triton

        contract["triton"] = triton.__version__
        if rt.cuda:
            from detrl.models.triton_ops import LAUNCH

            contract["triton_launch"] = dict(LAUNCH)  # pinned on every launch (the bits depend on it)
    except ImportError:
        pass
    return contract


def cpu_host() -> dict:
    """The CPU a run's bits came from: its model name, the vector ISA torch's kernels dispatch to, and the BLAS
    torch was built with (CPU gemms differ in bits between machines: a sweep gathered on several is not one
    machine's repeats)."""
    import platform
    import re

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
            )
    except OSError:
        pass
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "blas": blas[1] if blas else None}


def first_block(model, dtype: torch.dtype | None) -> Weights:
    """An FSDP2-sharded model as the 1-layer model of its config that the checks run on: the root group (embedding,
    final norm, lm_head) and block 0, gathered (collective), fused in `dtype`. Every layer has block 0's gemm
    shapes and ops, so the checks cover what the whole model runs, on the real weights, without it materialised."""
    import copy

    w = fuse(model, dtype)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return Weights(w.embed, [w.layers[0].load()], w.norm, w.lm_head, config)


def numerics_contract(det, rt, model, rope) -> dict:
    """Before step 0. determinism.kernels=batch_invariant: `require` with the run's ops (raises PreflightError) and
    the negative control with the device's default ops; off: nothing is checked. -> the run's numerics contract
    (JSON-able). `rt`: the run's detrl.runtime.Runtime."""
    import dataclasses

    import torch

    from detrl.models.ops import OP_SETS

    contract = _contract(rt)
    if not det.invariant_kernels:
        return {**contract, "preflight": "not run (determinism.kernels=default)"}
    with torch.no_grad():
        weights = (
            fuse(model, rt.ops.dtype) if not fsdp.is_sharded(model) else first_block(model, rt.ops.dtype)
        )
    require(weights, rt.ops, rt.ctx_len, rope)
    control = OP_SETS[(rt.device.type, False)]
    if rt.ops.dtype is not None:
        control = dataclasses.replace(control, dtype=rt.ops.dtype)
    found = negative_control(weights, control, rt.ctx_len, rope)
    if fsdp.is_sharded(model):
        contract["preflight_model"] = (
            f"1 of {model.config.num_hidden_layers} layers (sharded: block 0 gathered)"
        )
    if rt.device.type == "cpu":
        from detrl.models.ops import gemm_modes

        contract["gemm_modes"] = gemm_modes()  # what the preflight measured for the model's shapes
    return {
        **contract,
        "preflight": "passed: rows and prefill/decode phases bitwise equal",
        "gemm_rows_checked": list(ROWS[rt.device.type]),
        "negative_control": found or ["found nothing: on this device the check may be blind"],
    }
