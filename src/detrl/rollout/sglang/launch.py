"""Launch SGLang servers for `rollout=sglang`, with every argument checked by the installed SGLang first.

The launch arguments are parsed and resolved with SGLang's own `ServerArgs` before any process starts: an
argument the installed version lacks, or a combination its resolution refuses, fails at once in one line naming
it and the SGLang version.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from detrl.config import ConfigError

INSTALL_HINT = (
    "rollout=sglang needs SGLang to launch servers: on a GPU machine `pip install -e '.[sglang]'`; "
    "or attach to running servers with rollout.sglang.urls=[http://host:port]"
)


# torch dtype -> SGLang's --dtype choice (arg_groups/fields/model.py ServerArgs.dtype)
SGLANG_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def sglang_dtype(dtype) -> str:
    """The --dtype that serves a policy of torch dtype `dtype` as is (SGLang's default, "auto", serves a float32
    checkpoint as float16: configs/model_config.py `_get_and_verify_dtype`)."""
    try:
        return SGLANG_DTYPES[str(dtype)]
    except KeyError:
        raise ConfigError(
            f"rollout=sglang cannot serve a policy in {dtype}: SGLang's --dtype is one of "
            f"{sorted(set(SGLANG_DTYPES.values()))}"
        ) from None


def server_argv(
    model_path: str,
    port: int,
    seed: int,
    deterministic: bool,
    attention_backend: str,
    tp_size: int = 1,
    rl_on_policy_target: bool = False,
    extra: list[str] | None = None,
    dtype: str | None = None,
) -> list[str]:
    """`python -m sglang.launch_server` arguments for one server; `deterministic` adds SGLang's own switch,
    `dtype` (see `sglang_dtype`) the served dtype."""
    argv = [
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--random-seed",
        str(seed),
        "--tp-size",
        str(tp_size),
    ]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if deterministic:
        argv += ["--enable-deterministic-inference", "--attention-backend", attention_backend]
        if rl_on_policy_target:
            argv += ["--rl-on-policy-target", "fsdp"]
    return argv + list(extra or [])


def sglang_version() -> str:
    try:
        import sglang
    except ImportError as e:
        raise ConfigError(INSTALL_HINT) from e
    return sglang.__version__


def parse_server_args(argv: list[str]):
    """Parse `argv` with the installed SGLang's ServerArgs (server_args.py `prepare_server_args`), unresolved."""
    version = sglang_version()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        msg = err.getvalue().strip().splitlines()[-1:] or [str(e)]
        raise ConfigError(f"SGLang {version} rejects the launch arguments: {msg[0]}") from e
    if unknown:
        raise ConfigError(
            f"SGLang {version} has no server argument {unknown[0]!r} (from {' '.join(unknown)})"
        )
    try:
        return ServerArgs.from_cli_args(args)
    except Exception as e:  # noqa: BLE001 - SGLang's own validation, reported in one line
        raise ConfigError(f"SGLang {version} refuses the launch arguments: {str(e).splitlines()[0]}") from e


def check_server_args(argv: list[str]):
    """Parse `argv`, then run SGLang's resolution (server_args.py `ServerArgs.resolve_once`, which launch_server
    runs before it starts: arg_groups/pipeline.py `run_resolution_pipeline`, e.g. arg_groups/overrides.py
    `_deterministic_attention_backend`) -> the resolved ServerArgs. Any refusal is one ConfigError line; a
    resolution that cannot import one of SGLang's runtime dependencies (SGLang installed --no-deps) names it."""
    sa = parse_server_args(argv)
    version = sglang_version()
    environ = dict(os.environ)  # resolution handlers may set variables: they are the server's, not ours
    try:
        sa.resolve_once()
    except ImportError as e:
        raise ConfigError(
            f"SGLang {version} cannot resolve the launch arguments here: its dependency {e.name or e!s} is not "
            f"installed ({INSTALL_HINT})"
        ) from e
    except Exception as e:  # noqa: BLE001 - SGLang's own resolution, reported in one line
        raise ConfigError(f"SGLang {version} refuses the launch arguments: {str(e).splitlines()[0]}") from e
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return sa


def launch(argv: list[str], log_path: Path, gpu_ids: list[int] | None = None) -> subprocess.Popen:
    """Start one server (after check_server_args), its output streamed to `log_path`."""
    check_server_args(argv)
    env = dict(os.environ)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *argv], env=env, stdout=log, stderr=subprocess.STDOUT
    )
