"""The preflight checks the paged engine of the run's device: on CUDA the Triton kernel reading the KV pool in
place (`cuda_paged.device_ops`), here under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess)."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_helpers import run_script

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from detrl.models import preflight
    from detrl.models.forward import fuse, rope_tables
    from detrl.models.ops import BATCH_INVARIANT_OPS, CUDA_INVARIANT_OPS, DEFAULT_OPS
    from detrl.rollout.cuda_paged import KernelPool

    torch.manual_seed(0)
    c = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    w = fuse(Qwen3ForCausalLM(c).eval())
    ctx = 16
    rope = rope_tables(c, ctx)
    out = {"kernel_pool": isinstance(preflight._paged_pool(w, CUDA_INVARIANT_OPS, ctx, 8, 4)[1], KernelPool),
           "cpu_pool": type(preflight._paged_pool(w, BATCH_INVARIANT_OPS, ctx, 8, 4)[1]).__name__}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, ctx), generator=g)
    with torch.no_grad():
        full = preflight._logprobs_of(preflight.forward(w, ids, CUDA_INVARIANT_OPS, ctx, rope)[:, :-1], ids[:, 1:])
        out["invariant"] = preflight.check_paged(w, CUDA_INVARIANT_OPS, ctx, rope, ids, full, 3)
        # the trainer's rows from another op set: the paged path must then be found to differ
        other = preflight._logprobs_of(preflight.forward(w, ids, DEFAULT_OPS, ctx, rope)[:, :-1], ids[:, 1:])
        out["against_other"] = preflight.check_paged(w, CUDA_INVARIANT_OPS, ctx, rope, ids, other + 1e-3, 3)
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_script(SCRIPT)


def test_the_cuda_op_sets_check_the_paged_kernels_pool(interpreted):
    assert interpreted["kernel_pool"] is True
    assert interpreted["cpu_pool"] == "KVPool"


def test_the_paged_kernel_gives_the_trainers_logprobs_bitwise(interpreted):
    assert interpreted["invariant"] == []


def test_a_difference_is_found_and_named(interpreted):
    assert len(interpreted["against_other"]) == 1
    assert "paged chunked prefill + decode" in interpreted["against_other"][0]
