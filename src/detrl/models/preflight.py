"""Batch invariance proven on the run's own device, dtype and shapes, before step 0 (issue 16, started).

`check(weights, ops, ctx_len, rope)` runs the forward the way the sampler and the trainer do and compares bits:
- rows: the trainer's forward over a batch of whole sequences vs the same sequence alone (batch of 1) and in a
  batch of another size: every row's logprobs must be equal;
- phases: the sampler's prefill + KV-cache decode of a sequence vs the trainer's forward over it: the logprob
  of every decoded token must be equal (trainer == rollout, bitwise).
`require(...)` raises (fail-closed) when a check finds a difference; `negative_control(...)` runs the same checks
with the default op set and must find one (else the check proves nothing on this device).

Not yet wired into `train()` (it has not run on a GPU): the plan is `determinism=on` on CUDA calls
`require(...)` and `negative_control(...)` once before step 0 with the run's batch and ctx_len.
"""

from __future__ import annotations

import torch

from detrl.models.forward import KVCache, Weights, forward, log_probs
from detrl.models.ops import Ops


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return log_probs(logits, 1.0).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def check(weights: Weights, ops: Ops, ctx_len: int, rope, batch: int = 8, prompt_len: int = 3,
          seed: int = 0) -> list[str]:
    """Differences found (empty: invariant on these shapes). Sequences of random tokens on the weights' device."""
    dev, vocab = weights.embed.device, weights.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, ctx_len), generator=g).to(dev)
    full = _token_logprobs(forward(weights, ids, ops, ctx_len, rope)[:, :-1], ids[:, 1:])  # [B, L-1]
    found = []
    for rows in (slice(0, 1), slice(1, 1 + max(1, batch // 2 - 1))):  # alone, and in a batch of another size
        part = _token_logprobs(forward(weights, ids[rows], ops, ctx_len, rope)[:, :-1], ids[rows, 1:])
        if not torch.equal(part, full[rows]):
            found.append(f"rows {rows.start}..{rows.stop - 1}: trainer logprobs depend on the batch "
                         f"(max diff {(part - full[rows]).abs().max().item():.3g})")
    cache = KVCache.empty(weights.config, batch, ctx_len, weights.embed.dtype, dev)
    last = forward(weights, ids[:, :prompt_len], ops, ctx_len, rope, cache=cache,
                   last=torch.full((batch,), prompt_len - 1, device=dev))  # [B, V]
    decoded = []
    for pos in range(prompt_len, min(ctx_len, prompt_len + 6)):
        tok = ids[:, pos]
        decoded.append(_token_logprobs(last, tok))
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
        raise RuntimeError(f"determinism=on: batch invariance not proven on {weights.embed.device} "
                           f"({weights.embed.dtype}, ops {ops.name}): {found[0]}")


def negative_control(weights: Weights, ops: Ops, ctx_len: int, rope, **kw) -> list[str]:
    """The same checks with `ops` = a default op set: what they find (expected: something, on a GPU)."""
    return check(weights, ops, ctx_len, rope, **kw)
