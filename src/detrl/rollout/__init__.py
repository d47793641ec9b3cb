"""The rollout engines. `EmbeddedEngine` is imported on first use: the request types alone (what
`detrl.determinism`, and through it `detrl.report` and `detrl.compare`, need) do not load the model code."""

from detrl.rollout.base import Request, Result, SamplingParams

__all__ = ["EmbeddedEngine", "Request", "Result", "SamplingParams"]


def __getattr__(name: str):
    if name == "EmbeddedEngine":
        from detrl.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
