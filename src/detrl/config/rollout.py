"""The rollout group (`conf/rollout/*.yaml`): the engine, its batching, partial rollouts and SGLang servers."""

from __future__ import annotations

from dataclasses import dataclass, field

from detrl.config.base import check, choice

ROLLOUT_BACKENDS = ("embedded", "sglang")
SGLANG_ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton")  # the deterministic ones (--attention-backend)
OFF_CUTS = ("groups", "time")  # determinism.cut=async: what ends a generation call
BUDGET_RULE = "must be >= 0 (0 = auto: max_new_tokens / 4 a round)"


@dataclass
class PartialRolloutConfig:
    enabled: bool = False
    # determinism.cut=token_budget: new tokens per pending sample per generation round (the cut). Each round re-prefills prompt +
    # prefix, so a budget of 1 costs O(length^2): 0 = auto, ceil(rollout.max_new_tokens / ROUNDS_PER_RESPONSE)
    token_budget: int = 0
    oversample: float = 1.5  # prompt groups in flight per step, as a multiple of train_batch_size
    max_staleness: int = (
        2  # an unfinished sample whose oldest token is older than this many versions restarts
    )
    stale_tokens: str = "keep"  # keep (importance ratio vs the behaviour logprobs) | mask | rescore
    off_cut: str = "groups"  # determinism.cut=async: cut when the first groups finish (groups) or at a wall-clock budget (time)
    time_budget_s: float = 0.05  # off_cut=time: seconds of generation per call before the cut

    def validate(self) -> None:
        from detrl.algos.core import STALE_TOKENS

        check(self.token_budget >= 0, "rollout.partial.token_budget", self.token_budget, BUDGET_RULE)
        check(self.oversample >= 1.0, "rollout.partial.oversample", self.oversample, "must be >= 1")
        check(self.max_staleness >= 0, "rollout.partial.max_staleness", self.max_staleness, "must be >= 0")
        choice("rollout.partial.stale_tokens", self.stale_tokens, STALE_TOKENS)
        choice("rollout.partial.off_cut", self.off_cut, OFF_CUTS)
        check(self.time_budget_s > 0, "rollout.partial.time_budget_s", self.time_budget_s, "must be > 0")


@dataclass
class SGLangConfig:
    urls: list[str] = field(
        default_factory=list
    )  # attach to running servers (SGLang or python -m detrl.serve)
    num_servers: int = 1  # servers to launch when urls is empty
    gpu_ids: list[list[int]] = field(default_factory=list)  # per server (CUDA_VISIBLE_DEVICES); [] = inherit
    tp_size: int = 1
    port: int = 30000  # first port; server i listens on port + i
    attention_backend: str = "fa3"  # with determinism on: fa3 (Hopper), flashinfer or triton
    rl_on_policy_target: bool = (
        False  # adds --rl-on-policy-target fsdp (checked against the installed SGLang)
    )
    health_timeout_s: float = 120.0  # attached or launched servers; progress printed every 30 s
    timeout_s: float = 120.0
    retries: int = 3

    def validate(self) -> None:
        """Checked only when rollout.backend=sglang."""
        check(self.num_servers >= 1, "rollout.sglang.num_servers", self.num_servers, "must be >= 1")
        choice("rollout.sglang.attention_backend", self.attention_backend, SGLANG_ATTENTION_BACKENDS)


@dataclass
class RolloutConfig:
    backend: str = "embedded"  # embedded | sglang
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    num_workers: int = 2  # engine worker processes (replicas), each batching what is routed to it
    max_batch_size: int = 128  # requests per engine batch (continuous: running sequences per worker)
    scheduler: str = "continuous"  # continuous (paged KV, prefix sharing) | static (the baseline's batches)
    block_size: int = 8  # KV tokens per pool block
    prefill_chunk: int = 64  # prompt tokens a sequence prefills per step
    kv_pool_tokens: int = (
        0  # KV tokens per worker pool; 0 = min(max_batch_size x ctx_len, the cap, half the free memory)
    )
    kv_pool_max_tokens: int = 65536  # the cap on an automatic pool (kv_pool_tokens=0), per worker / engine
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def validate(self) -> None:
        from detrl.rollout.batching import SCHEDULERS

        choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        if self.backend == "sglang":
            self.sglang.validate()
        check(self.n >= 1, "rollout.n", self.n, "must be >= 1")
        check(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        for key in ("max_new_tokens", "num_workers", "max_batch_size"):
            check(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), "must be >= 1")
        choice("rollout.scheduler", self.scheduler, SCHEDULERS)
        for key in ("block_size", "prefill_chunk"):
            check(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), "must be >= 1")
        check(
            self.kv_pool_tokens >= 0, "rollout.kv_pool_tokens", self.kv_pool_tokens, "must be >= 0 (0 = auto)"
        )
        check(
            self.kv_pool_max_tokens >= 1,
            "rollout.kv_pool_max_tokens",
            self.kv_pool_max_tokens,
            "must be >= 1",
        )
        self.partial.validate()
