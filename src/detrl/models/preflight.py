"""Batch invariance proven on the run's own device, dtype and shapes, before step 0 (issue 16, started).

`check(weights, ops, ctx_len, rope)` runs the forward the way the sampler and the trainer do and compares bits:
- rows: the trainer's forward over a batch of whole sequences vs the same sequence alone (batch of 1) and in a
  batch of another size: every row's logprobs must be equal;
- phases: the sampler's prefill + KV-cache decode of a sequence vs the trainer's forward over it: the logprob
  of every decoded token must be equal (trainer == rollout, bitwise).
`require(...)` raises (fail-closed) when a check finds a difference; `negative_control(...)` runs the same checks
with the default op set and must find one (else the check proves nothing on this device).

`numerics_contract(...)` is what `train()` runs before step 0: under `determinism=on` it requires the checks
to pass with the run's op set, device, dtype, ctx_len and model (one line naming what varies, else the run does
not start), runs the negative control with the device's default op set, and returns the run's "numerics
contract" (the result, the op sets, the device, versions and environment), written to <run_dir>/numerics.json.
"""

from __future__ import annotations

import os

import torch

from detrl.config import ConfigError
from detrl.models.forward import KVCache, Weights, forward, fuse, token_logprobs
from detrl.models.ops import Ops


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_logprobs(logits, targets, 1.0)[0]


class PreflightError(ConfigError):
    """determinism=on cannot be honoured here: the check found a row or phase that varies (one line)."""


@torch.no_grad()
def check(weights: Weights, ops: Ops, ctx_len: int, rope, batch: int = 8, prompt_len: int = 3,
          seed: int = 0) -> list[str]:
    """Differences found (empty: invariant on these shapes). Sequences of random tokens on the weights' device."""
    dev, vocab = weights.embed.device, weights.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, ctx_len), generator=g).to(dev)
    full = _logprobs_of(forward(weights, ids, ops, ctx_len, rope)[:, :-1], ids[:, 1:])  # [B, L-1]
    found = []
    for rows in (slice(0, 1), slice(1, 1 + max(1, batch // 2 - 1))):  # alone, and in a batch of another size
        part = _logprobs_of(forward(weights, ids[rows], ops, ctx_len, rope)[:, :-1], ids[rows, 1:])
        if not torch.equal(part, full[rows]):
            found.append(f"rows {rows.start}..{rows.stop - 1}: trainer logprobs depend on the batch "
                         f"(max diff {(part - full[rows]).abs().max().item():.3g})")
    cache = KVCache.empty(weights.config, batch, ctx_len, weights.embed.dtype, dev)
    last = forward(weights, ids[:, :prompt_len], ops, ctx_len, rope, cache=cache,
                   last=torch.full((batch,), prompt_len - 1, device=dev))  # [B, V]
    decoded = []
    for pos in range(prompt_len, min(ctx_len, prompt_len + 6)):
        tok = ids[:, pos]
        decoded.append(_logprobs_of(last, tok))
        last = forward(weights, tok[:, None], ops, ctx_len, rope, cache=cache,
                       positions=torch.full((batch, 1), pos, device=dev))[:, 0]
    decoded = torch.stack(decoded, 1)  # [B, steps]
    want = full[:, prompt_len - 1 : prompt_len - 1 + decoded.shape[1]]
    if not torch.equal(decoded, want):
        found.append(f"prefill + decode vs the trainer's forward: logprobs differ (max diff "
                     f"{(decoded - want).abs().max().item():.3g})")
    return found


def require(weights: Weights, ops: Ops, ctx_len: int, rope, **kw) -> None:
    found = check(weights, ops, ctx_len, rope, **kw)
    if found:
        raise PreflightError(f"determinism=on refused: batch invariance not proven on {weights.embed.device} "
                             f"({weights.embed.dtype}, ops {ops.name}): {found[0]}")


def negative_control(weights: Weights, ops: Ops, ctx_len: int, rope, **kw) -> list[str]:
    """The same checks with `ops` = a default op set: what they find (expected: something, on a GPU)."""
    return check(weights, ops, ctx_len, rope, **kw)


ENV_KEYS = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NCCL_ALGO", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def numerics_contract(det, model, ctx_len: int, rope) -> dict:
    """Before step 0. determinism=on: `require` with the run's ops (raises PreflightError) and the negative
    control with the device's default ops; off: nothing is checked. -> the run's numerics contract (JSON-able)."""
    import torch

    from detrl.models.ops import CUDA_DEFAULT_OPS, DEFAULT_OPS

    dev = torch.device(det.device)
    contract = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "dtype": str(det.dtype), "ops": det.ops.name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    try:
        import triton

        contract["triton"] = triton.__version__
    except ImportError:
        pass
    if not det.invariant_kernels:
        return {**contract, "preflight": "not run (determinism.kernels=default)"}
    with torch.no_grad():
        weights = fuse(model, det.ops.dtype)
    require(weights, det.ops, ctx_len, rope)
    control = CUDA_DEFAULT_OPS if dev.type == "cuda" else DEFAULT_OPS
    if det.ops.dtype is not None:
        import dataclasses

        control = dataclasses.replace(control, dtype=det.ops.dtype)
    found = negative_control(weights, control, ctx_len, rope)
    return {**contract, "preflight": "passed: rows and prefill/decode phases bitwise equal",
            "negative_control": found or ["found nothing: on this device the check may be blind"]}
