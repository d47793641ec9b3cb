"""SGLang: the client engine (`rollout=sglang`), the launcher and the stand-in server (`python -m detrl.serve`)."""

from detrl.rollout.sglang.client import ServerError, SGLangEngine
from detrl.rollout.sglang.weights import save_weights

__all__ = ["SGLangEngine", "ServerError", "save_weights"]
