from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.embedded import EmbeddedEngine

__all__ = ["EmbeddedEngine", "Request", "Result", "SamplingParams"]
