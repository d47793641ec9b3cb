"""The third-party modules that SGLang's modules import at module level, once the contract tests' entry points
(`sglang.srt.server_args`, `sglang.srt.sampling.sampling_params`) are imported. `make test` installs SGLang with
--no-deps, so each of these must be named in the Makefile's SGLANG_IMPORTS (as its distribution name).

    python tests/sglang_imports.py      # prints them
"""

from __future__ import annotations

import ast
import sys

ENTRY_POINTS = ("sglang.srt.server_args", "sglang.srt.sampling.sampling_params")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {
    "IPython": "ipython",
    "PIL": "pillow",
    "zmq": "pyzmq",
    "typing_extensions": "typing-extensions",
    "pydantic_core": "pydantic",
}
PROVIDED = {"torch", "triton", "sglang"}  # installed by the Makefile's own pins


def module_level_imports() -> set[str]:
    import importlib

    for name in ENTRY_POINTS:
        importlib.import_module(name)
    found = set()
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not name.startswith("sglang") or not path or not path.endswith(".py"):
            continue
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in PROVIDED}


def distributions() -> set[str]:
    return {DISTRIBUTIONS.get(m, m) for m in module_level_imports()}


if __name__ == "__main__":
    print(" ".join(sorted(distributions())))
